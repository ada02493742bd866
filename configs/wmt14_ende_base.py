"""The paper's base model on WMT14 English->German (newstest2014 test, 27.3 tokenized BLEU)."""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'tfds'
    c.tfds_name = 'wmt14_translate/de-en'
    c.source_lang, c.target_lang = 'en', 'de'
    c.vocab_size = 37000  # the paper's shared byte-pair vocabulary of about 37k tokens
    c.max_len = 256
    c.batch_size = 104  # ~25k source and ~25k target tokens per batch, as in the paper
    c.num_train_steps = 100_000
    c.dtype = 'bfloat16'
    # The fused loss (t2t/loss.py): the plain loss's value and gradient without float32 [B, T, V]
    # logits in memory (tests/test_loss_impl.py); loss_impl='plain' trains on the model's logits().
    c.loss_impl = 'fused'
    # A chip holding few rows makes short chunks, each a read and write of the float32 dW [V, D]
    # in HBM: chunks grown to this many target tokens a chip, whose float32 logits a v5e chip
    # still keeps on chip (bench/RESULTS.md, "The loss chunks and XLA's negative estimate");
    # with more rows a chip the chunks stay at loss_chunk_len.
    c.loss_chunk_tokens = 768
    # bfloat16 attention weights the one copy of the softmax kept for the backward pass: less HBM
    # traffic a layer (bench/RESULTS.md, "The loss chunks and XLA's negative estimate").
    c.softmax_residual = 'compute'
    # Unrolled layers: by TPU AOT compile the scanned stacks need more temporaries per chip for the
    # same matmul FLOPs (the forward scan saves per-layer float32 activations and softmax
    # probabilities and bf16 copies of the weights; bench/RESULTS.md, "TPU ahead-of-time: scanned
    # against unrolled layers"). Unrolled fits larger batches and recomputes nothing; scanned
    # layers compile faster, and with remat='dots_saveable' keep less but recompute every step.
    c.scan_layers = False
    # threefry: under a sharded batch its dropout bits are drawn per shard, inside the dropout
    # fusions; rbg and unsafe_rbg draw the global batch's bits on every device (as many times the
    # bits as batch shards: more temporaries and HBM traffic; bench/RESULTS.md).
    c.rng_impl = 'threefry'
    c.checkpoint_every_steps = 2000
    c.keep_checkpoints = 5  # the paper averages the last 5 checkpoints of base
    c.lock()
    return c
