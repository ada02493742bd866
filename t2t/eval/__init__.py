"""Evaluation around the model: checkpoints scored, ensembles, --watch, bulk
translation, BLEU, forced-decoding scores, attention maps."""
