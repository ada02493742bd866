"""The training loop: metrics, evaluation, checkpoints, preemption, the time budget and
the divergence guards around the train step of t2t/train_lib.py."""
