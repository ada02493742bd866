"""The paper's big model on WMT14 English->German (28.4 tokenized BLEU on newstest2014)."""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'tfds'
    c.tfds_name = 'wmt14_translate/de-en'
    c.source_lang, c.target_lang = 'en', 'de'
    c.vocab_size = 37000
    c.max_len = 256
    c.batch_size = 104
    c.d_model, c.d_ff, c.num_heads = 1024, 4096, 16
    c.dropout_rate = 0.3  # the paper's P_drop for big EN-DE
    c.num_train_steps = 300_000
    c.dtype = 'bfloat16'
    # The fused loss (t2t/loss.py): the plain loss's value and gradient without float32 [B, T, V]
    # logits in memory (tests/test_loss_impl.py); loss_impl='plain' trains on the model's logits().
    c.loss_impl = 'fused'
    # Grown chunks, as in wmt14_ende_base: fewer passes of the float32 dW through HBM when a
    # chip holds few rows.
    c.loss_chunk_tokens = 768
    # bfloat16 attention weights the one copy of the softmax kept for the backward pass: less HBM
    # traffic a layer (bench/RESULTS.md, "The loss chunks and XLA's negative estimate").
    c.softmax_residual = 'compute'
    # Unrolled layers: by TPU AOT compile the scanned stacks need more temporaries per chip for the
    # same matmul FLOPs (the forward scan saves per-layer float32 activations and softmax
    # probabilities and bf16 copies of the weights; bench/RESULTS.md, "TPU ahead-of-time: scanned
    # against unrolled layers"), even with remat='dots_saveable'; scan_layers=True only compiles
    # faster.
    c.scan_layers = False
    # threefry: under a sharded batch its dropout bits are drawn per shard, inside the dropout
    # fusions; rbg and unsafe_rbg draw the global batch's bits on every device (as many times the
    # bits as batch shards: more temporaries and HBM traffic; bench/RESULTS.md).
    c.rng_impl = 'threefry'
    c.checkpoint_every_steps = 5000
    c.keep_checkpoints = 20  # the paper averages the last 20 checkpoints of big
    c.lock()
    return c
