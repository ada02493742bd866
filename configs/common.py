"""Shared pieces of every experiment config.

`base_config()` holds every key the code reads, with the paper's values where the paper has one;
each experiment file starts from it, changes what differs and returns it locked, so that
`--config.key=value` with an unknown key is an error that names the key.
"""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # --- data
    c.dataset = 'embedded'  # 'embedded' (Debian trans-de-en), 'tfds', 'tsv', 'hf' or 'recall'
    c.tfds_name = 'wmt14_translate/de-en'
    c.source_lang = 'en'
    c.target_lang = 'de'
    c.train_split = 'train'
    c.eval_split = 'validation'
    c.test_split = 'test'
    c.tsv_files = ml_collections.ConfigDict({'train': '', 'validation': '', 'test': ''})
    # dataset='hf' (t2t/data/hf.py): a directory saved by save_to_disk, or 'parquet', 'json',
    # 'csv' with data files (paths or globs, comma-separated) per split; streamed or converted
    # once to Arrow under data_dir; the fields ('' : translation.<source_lang> / <target_lang>)
    c.hf_path = ''
    c.hf_data_files = ml_collections.ConfigDict({'train': '', 'validation': '', 'test': ''})
    c.hf_streaming = False
    c.hf_source_field = ''
    c.hf_target_field = ''
    c.data_dir = 'data'  # prepared datasets, tokenizers and packed caches live here
    # '' or a bucket (gs://...) all hosts read: process 0 uploads the prepared data there, the
    # other hosts copy it into their own data_dir and never tokenize (docs/data.md)
    c.shared_data_dir = ''
    # Several processes: how long the others wait (host-side, a progress line a minute) for
    # process 0 to prepare the data, before stopping with a line that says what they waited for.
    c.data_wait_timeout_s = 6 * 3600.0
    c.vocab_size = 32000  # one sentencepiece vocabulary shared by source and target
    c.vocab_path = ''  # '' -> derived from data_dir, dataset and vocab_size
    c.tokenizer_sentences = 1_000_000  # sentences (source + target) used to train sentencepiece
    c.tokenizer_character_coverage = 0.9999  # rarer characters become UTF-8 byte pieces
    c.vocab_seed = 0  # the vocabulary's sample of sentences (not shuffle_seed: seeds share one)
    c.max_len = 256  # tokens per side of one packed training row; longer pairs are skipped
    c.max_eval_len = 256  # evaluation pairs longer than this are skipped (and counted)
    # True: validation/test pairs dropped while reading (an empty side, invalid UTF-8, ...) are
    # counted and left out; False: they are an error (BLEU on fewer references is never silent).
    c.allow_eval_drops = False
    c.batch_size = 128  # packed rows per global batch (~ batch_size * max_len * fill target tokens)
    c.eval_batch_size = 64  # sentences per evaluation batch (unpacked, last batch padded)
    c.pack = True
    c.shuffle_seed = 0  # the order of the training rows (the vocabulary and caches stay)
    # A resumed run whose batch size or packed training cache differs from its checkpoint's is an
    # error unless this is True (then the data position is mapped by rows consumed, and logged).
    c.allow_data_change = False
    # Several training corpora mixed by weight, each with an optional tag put first in its
    # sources (tagged back-translation), e.g. 'embedded=3; tsv:bt.tsv=1:<BT>'; '' trains on
    # `dataset`'s training split alone (docs/data.md, t2t/data/mixture.py)
    c.train_mixture = ''
    c.spm_alpha = 0.0  # > 0: subword regularization, training pairs re-segmented by sampling
    c.spm_nbest_size = -1  # spm_alpha > 0: sample among every segmentation (-1) or the n best
    # dataset='recall' (t2t/data/recall.py): source length, training draws, held-out sequences
    c.recall_length = 8
    c.recall_train_examples = 20_000
    c.recall_eval_examples = 1000  # in validation and in test each
    c.recall_distractors = False  # True: '0' / '1' also occur after position 0

    # --- model (the paper's base) ---------------------------------------------------------------
    c.d_model = 512
    c.d_ff = 2048
    c.num_heads = 8
    c.num_encoder_layers = 6
    c.num_decoder_layers = 6
    c.dropout_rate = 0.1  # sub-layer outputs and embeddings + positions
    c.attention_dropout_rate = 0.0  # on attention weights (tensor2tensor's base: 0.0)
    c.relu_dropout_rate = 0.0  # on the feed-forward's ReLU activations
    c.pre_ln = False  # the paper is post-LN: LayerNorm(x + Sublayer(x))
    c.position_embedding = 'sinusoidal'  # 'sinusoidal', 'learned', 'rope' or 'none'
    c.max_position = 1024  # size of the position table (learned / sinusoidal)
    c.scale_attention = True  # divide logits by sqrt(d_k)
    # Biases in the attention's q/k/v/o projections: none in the paper's equations, tensor2tensor
    # or flax's wmt example (the key bias would get an exactly zero gradient). Checkpoints written
    # with them restore with --config.attention_bias=True.
    c.attention_bias = False
    c.scale_embeddings = True  # multiply embeddings by sqrt(d_model)
    c.share_embeddings = True  # one embedding for source and target
    c.tie_output = True  # the output projection is the (target) embedding transposed
    c.dtype = 'float32'  # compute dtype: 'float32' or 'bfloat16' (parameters stay float32)
    # 'auto' (cuDNN flash attention on an NVIDIA GPU where cuDNN takes the config, else 'xla';
    # chosen once the devices are known, the reason printed: t2t/attention_choice.py), 'xla'
    # (einsum + softmax), 'dot_product' (jax.nn.dot_product_attention, jax picks the kernel),
    # 'cudnn' (the same, forced to cuDNN flash attention with sequence lengths and the causal
    # flag: GPU with bfloat16 only; packed rows fall back to a mask) or 'splash' (the Pallas
    # splash attention kernel with segment ids: TPU only)
    c.attention_impl = 'auto'
    # What the written-out attention's backward pass keeps of the softmax: 'float32' (autodiff of
    # the float32 softmax: its output and sums) or 'compute' (only the weights in the compute
    # dtype, the gradient still in float32: less memory traffic in bfloat16, gradients differing
    # by bfloat16 rounding of the weights; the same in float32)
    c.softmax_residual = 'float32'
    # Speed and memory levers that leave the results unchanged (bench/RESULTS.md has numbers):
    c.remat = 'none'  # per layer: 'none', 'dots_saveable' (recompute all but matmuls) or 'full'
    c.scan_layers = False  # one nn.scan per stack: faster compiles; parameters stacked per layer
    c.loss_chunk_len = 32  # target positions per chunk of the fused cross-entropy (0 = one chunk)
    # > 0: the chunk length doubled while a device's chunk (its rows x positions) holds at most
    # this many target tokens: fewer passes of the float32 dW accumulator through memory
    c.loss_chunk_tokens = 0
    # The token table read through t2t/tables.py: one copy per data-parallel batch shard (its
    # gradient reduced once a step), fsdp's lookups whole along D. False: the textbook
    # jnp.take(E, ids) and y @ E.T (on one device the same computation)
    c.table_copies = True
    c.rng_impl = 'threefry'  # dropout keys: 'threefry', 'rbg' or 'unsafe_rbg' (faster on GPU/TPU)

    # --- optimization
    c.learning_rate_scale = 1.0  # lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    c.warmup_steps = 4000
    c.adam_b1 = 0.9
    c.adam_b2 = 0.98
    c.adam_eps = 1e-9
    c.weight_decay = 0.0
    c.clip_grad_norm = 0.0  # 0 = off
    c.label_smoothing = 0.1
    # The loss: 'plain' (label-smoothed cross-entropy on the model's logits(), t2t/loss.py) or
    # 'fused' (the same from the decoder output, chunk by chunk: no [B, T, V] logits in memory)
    c.loss_impl = 'plain'
    c.z_loss = 0.0  # weight of log(Z)^2 per token in the loss (t5x's z-loss; 0 = off)
    c.grad_accum_steps = 1  # micro-batches per update; batch_size is split across them
    c.num_train_steps = 100_000
    c.train_time_budget_s = 0.0  # > 0: stop (and save) after this many seconds of training
    c.skip_nonfinite = False  # True: skip a step whose loss is NaN/inf instead of stopping
    c.ema_decay = 0.0  # > 0: keep ema = d*ema + (1-d)*params after each update (0 = off)
    c.ema_warmup = False  # True: update t uses min(ema_decay, (1+t)/(10+t)) (TF's num_updates)
    # Divergence guards (t2t/train/guards.py; MaxText's skip_step_on_spikes, PaLM's rollbacks):
    c.spike_skip = 0.0  # > 0: skip a step whose loss > recent mean + this x std (0 = off)
    c.spike_window = 100  # the recent applied steps whose loss mean and std spike_skip uses
    # > 0: after this many skipped (spike or non-finite) steps in a row, go back to the last
    # checkpoint before them and skip the batches since it (0 = off)
    c.rollback_after = 0
    c.seed = 0

    # --- loop, checkpoints, evaluation
    c.log_every_steps = 100
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 5000
    c.keep_checkpoints = 20
    # Checkpoint averaging reads only checkpoints of the run's final fraction of steps (evaluate.py
    # --average_final); --average_last=N reaching before it warns (t2t/eval/averaging.py).
    c.average_fraction = 0.25
    c.num_eval_batches = 20  # validation batches for eval loss (-1 = all)
    c.eval_bleu_sentences = 256  # validation sentences decoded for BLEU at each eval (0 = off)
    # Best checkpoints and early stopping (t2t/run/best.py): evaluations ranked by best_metric, one
    # of 'loss', 'bleu', 'chrf' (validation; 'bleu' and 'chrf' need eval_bleu_sentences > 0), or the
    # same of the EMA weights: 'loss_ema', 'bleu_ema', 'chrf_ema' (ema_decay > 0).
    c.keep_best = 0  # > 0: the checkpoints of the N best evaluations also stay (0 = off)
    c.best_metric = 'loss'
    c.early_stopping_patience = 0  # > 0: stop after N evaluations without improvement (0 = off)
    # Hangs and stragglers (t2t/infra/watchdog.py): every thread's stack goes to stderr, training
    # goes on.
    c.straggler_factor = 10.0  # a step running over this x the median recent step (0 = off) ...
    c.straggler_min_s = 10.0  # ... and over this many seconds (tiny steps jitter)
    c.slow_save_s = 600.0  # a checkpoint save running over this many seconds (0 = off)
    # A step, save (plus storage_outage_limit_s) or evaluation running this long is stuck (e.g. a
    # collective whose peer never comes): stacks, then exit 3 for a restart. On by default, as
    # nothing else ends such a job; well above a cold compile or a full BLEU pass (0 = off).
    c.hang_timeout_s = 1800.0
    # A checkpoint save or metrics write failing on transient storage errors (a bucket's 503s,
    # resets) is retried this long, in the background while training goes on, before the run
    # ends with exit 5 (0: not retried; else at least the longest wait between two tries, 8 s).
    # Regional storage incidents outlast the clients' own half-minute retries.
    c.storage_outage_limit_s = 1800.0
    # The bytes of metrics, events and ledger records a process keeps for a bucket that does not
    # answer (docs/goodput.md); training waits only while this much is waiting.
    c.storage_queue_mb = 64.0
    # Where the time goes (docs/goodput.md): WORKDIR/goodput/ from process 0, or from every one.
    c.goodput_all_processes = False
    # A jax.profiler trace of steps [start, start + num) into WORKDIR/profiles/ (0 = none), again
    # every profile_every_steps (0 = once); process 0 only unless profile_all_processes.
    c.profile_start_step = 0
    c.profile_num_steps = 3
    c.profile_every_steps = 0
    c.profile_all_processes = False
    # jax's persistent compilation cache (t2t/run/compile_cache.py): '' = $JAX_COMPILATION_CACHE_DIR
    # or ~/.cache/t2t/jax (host-local), 'off', or a directory / gs:// URL.
    c.compilation_cache_dir = ''
    # True: also store the train / eval steps' whole executables there (t2t-executables/), so a
    # restart of a single-process run traces nothing. Off by default: XLA:CPU's serialized
    # executables are young (docs/goodput.md).
    c.store_executables = False
    # Where the logged scalars go besides stdout and WORKDIR/metrics.jsonl (t2t/infra/trackers.py):
    # any of 'tensorboard' (event files in WORKDIR), 'wandb', 'trackio' (pip install
    # 't2t[trackers]'). W&B runs offline unless wandb_mode='online' ('wandb sync' uploads later).
    c.trackers = ('tensorboard',)
    c.wandb_mode = 'offline'  # 'offline', 'online' or 'disabled'
    c.tracker_project = ''  # the W&B / trackio project ('' : the workdir's name)
    c.tracker_dir = ''  # where W&B and trackio write ('' : WORKDIR/trackers; a bucket needs one)

    # --- decoding
    c.decode_strategy = 'beam'  # 'beam' (beam_size, alpha), 'greedy' (argmax) or 'sample'
    c.temperature = 1.0  # decode_strategy='sample': logits / temperature (1: the model's own)
    c.top_k = 0  # decode_strategy='sample': draw from the k most likely tokens (0: all)
    c.top_p = 1.0  # decode_strategy='sample': then from the fewest holding this mass (1: all)
    c.decode_seed = 0  # decode_strategy='sample': a sentence's draw = f(this, its source tokens)
    c.beam_size = 4
    c.length_penalty_alpha = 0.6
    # A hypothesis cut at its length limit without EOS: 'fallback' (tensor2tensor) counts it only
    # when no hypothesis of that sentence ended in EOS; 'compete' ranks it with the EOS ones.
    c.beam_unfinished = 'fallback'
    # When a sentence's search stops: 'bound' (tensor2tensor) once no alive hypothesis can beat
    # the worst of its beam_size finished ones, exact; 'k_finished' (fairseq, CTranslate2) once
    # beam_size hypotheses have finished: sooner, and a hypothesis that would win later is lost.
    c.beam_stop = 'bound'
    c.max_decode_extra = 50  # max output length = source length + this
    # Beam search drops finished sentences from the batch: it compacts to a quarter of its rows at
    # a time as they end, down to this many sentences (0: the whole batch to the end; decode.py).
    c.beam_shrink_floor = 8
    c.max_decode_len = 256  # static length bound of the decode buffers

    # --- devices
    c.mesh_shape = (-1, 1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices
    # Several slices (TPU multislice; on CPU/GPU each process stands for one): the mesh of slices
    # over the data-center network; mesh_shape is then the mesh inside one slice.
    c.dcn_mesh_shape = (1, 1, 1)
    return c


def wmt14(target_lang: str, size: str) -> ml_collections.ConfigDict:
    """The paper's WMT14 setup, English to target_lang ('de' or 'fr'), at its base or big size
    (Table 3), with the TPU levers the wmt14 experiments share; unlocked: the experiment sets
    its vocabulary and dropout and locks it."""
    c = base_config()
    c.dataset = 'tfds'
    c.tfds_name = f'wmt14_translate/{target_lang}-en'
    c.source_lang, c.target_lang = 'en', target_lang
    c.max_len = 256
    c.batch_size = 104  # ~25k source and ~25k target tokens per batch, as in the paper
    if size == 'big':
        c.d_model, c.d_ff, c.num_heads = 1024, 4096, 16
        c.num_train_steps, c.checkpoint_every_steps = 300_000, 5000
        c.keep_checkpoints = 20  # the paper averages the last 20 checkpoints of big
    elif size == 'base':
        c.num_train_steps, c.checkpoint_every_steps = 100_000, 2000
        c.keep_checkpoints = 5  # the paper averages the last 5 checkpoints of base
    else:
        raise ValueError(f"size={size!r}; one of ('base', 'big')")
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
    # against unrolled layers"), even with remat='dots_saveable'. Unrolled fits larger batches and
    # recomputes nothing; scanned layers only compile faster.
    c.scan_layers = False
    # threefry: under a sharded batch its dropout bits are drawn per shard, inside the dropout
    # fusions; rbg and unsafe_rbg draw the global batch's bits on every device (as many times the
    # bits as batch shards: more temporaries and HBM traffic; bench/RESULTS.md).
    c.rng_impl = 'threefry'
    return c
