"""The paper's big model on WMT14 English->French (41.8 tokenized BLEU on newstest2014)."""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'tfds'
    c.tfds_name = 'wmt14_translate/fr-en'
    c.source_lang, c.target_lang = 'en', 'fr'
    c.vocab_size = 32000  # the paper's 32000 word-piece vocabulary for EN-FR
    c.max_len = 256
    c.batch_size = 104
    c.d_model, c.d_ff, c.num_heads = 1024, 4096, 16
    c.dropout_rate = 0.1  # EN-FR big used P_drop = 0.1, not 0.3
    c.num_train_steps = 300_000
    c.dtype = 'bfloat16'
    # The fused loss (t2t/loss.py): the plain loss's value and gradient without float32 [B, T, V]
    # logits in memory (tests/test_loss_impl.py); loss_impl='plain' trains on the model's logits().
    c.loss_impl = 'fused'
    # Grown chunks, as in wmt14_ende_base: fewer passes of the float32 dW through HBM when a
    # chip holds few rows.
    c.loss_chunk_tokens = 768
    # As in wmt14_ende_big: the bfloat16 attention weights kept for the backward pass.
    c.softmax_residual = 'compute'
    # Unrolled layers, as in wmt14_ende_big (the same model but for the vocabulary): scanned stacks
    # take more temporaries per chip for the same matmul FLOPs and only compile faster.
    c.scan_layers = False
    # threefry: under a sharded batch its dropout bits are drawn per shard, inside the dropout
    # fusions; rbg and unsafe_rbg draw the global batch's bits on every device (as many times the
    # bits as batch shards: more temporaries and HBM traffic; bench/RESULTS.md).
    c.rng_impl = 'threefry'
    c.checkpoint_every_steps = 5000
    c.keep_checkpoints = 20
    c.lock()
    return c
