"""The peers' sections, each run in its own process by bench/peers_gpu.py (--section NAME).

  hw     device info, bf16 matmul TFLOP/s (8192^3), device-to-device copy GB/s (read+write bytes)
  hf     HF transformers MarianMTModel (BASE shape, random init, bf16): beam-search generate
  torch  reference torch.nn.Transformer (post-LN, ReLU, dropout 0.1, one 32k embedding for source,
         target and tied output), label-smoothed CE, fused Adam, bf16 autocast, torch.compile
  jax    flax examples/wmt models.py + decode.py, verbatim in .peer/flax_wmt/ (not committed):
         BASE, BIG training steps (bf16) and decode.beam_search (beam 4, alpha 0.6)
"""

import functools
import gc
import math
import os
import statistics
import subprocess
import sys
import time

import benchlib
from peers_common import (
    NO_EOS,
    decode_metrics,
    decode_src,
    emit,
    measure,
    time_runs,
    train_metrics,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# hw
def section_hw(cfg, tiny):
    import torch

    dev = 'cpu' if tiny else 'cuda'

    def bench(
        fn, warmup=3, reps=10
    ):  # per-rep seconds: CUDA event pairs on the GPU, wall clock on CPU
        for _ in range(warmup):
            fn()
        if dev == 'cpu':
            return time_runs(fn, reps, reps)
        torch.cuda.synchronize()
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for a, b in ev:
            a.record(), fn(), b.record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in ev]

    def info():
        r = dict(
            python=sys.version.split()[0],
            torch=torch.__version__,
            cuda_available=torch.cuda.is_available(),
        )
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            r.update(
                gpu=p.name,
                cc=f'{p.major}.{p.minor}',
                mem_gib=p.total_memory / 2**30,
                sms=p.multi_processor_count,
                cuda=torch.version.cuda,
            )
            q = '--query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory,power.limit'
            try:
                r['nvidia_smi'] = subprocess.run(
                    ['nvidia-smi', q, '--format=csv,noheader'],
                    capture_output=True,
                    text=True,
                    timeout=20,
                ).stdout.strip()
            except Exception as e:
                r['nvidia_smi'] = repr(e)
        return r

    def matmul():
        n = cfg['mm_n']
        a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
        c = torch.empty_like(a)
        ts = bench(lambda: torch.mm(a, b, out=c))
        return dict(
            n=n,
            reps=len(ts),
            ms_median=statistics.median(ts) * 1e3,
            achieved_tflops=2 * n**3 / statistics.median(ts) / 1e12,
            tflops_best=2 * n**3 / min(ts) / 1e12,
        )

    def copy():
        nbytes = cfg['copy_mib'] * 2**20
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ts = bench(lambda: dst.copy_(src))
        return dict(
            mib=cfg['copy_mib'],
            reps=len(ts),
            gbs_median=2 * nbytes / statistics.median(ts) / 1e9,
            gbs_best=2 * nbytes / min(ts) / 1e9,
            counted='read+write bytes',
        )

    measure('hw', 'device_info', 0, info)
    measure('hw', 'matmul_bf16', 5, matmul)
    measure('hw', 'copy_d2d', 5, copy)


# torch reference
def section_torch(cfg, tiny):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    dev = 'cpu' if tiny else 'cuda'
    V, B, S = cfg['vocab'], cfg['batch'], cfg['seq']

    class NMT(nn.Module):
        """Transformer of Vaswani et al. 2017: post-LN, ReLU, dropout 0.1, sinusoidal positions,
        one embedding shared by source, target and the tied output projection (inputs scaled by
        sqrt(d))."""

        def __init__(self, d, h, ff, layers, max_len=1024):
            super().__init__()
            self.tf = nn.Transformer(
                d,
                h,
                layers,
                layers,
                ff,
                dropout=0.1,
                activation='relu',
                batch_first=True,
                norm_first=False,
            )
            self.emb = nn.Embedding(V, d)
            nn.init.normal_(self.emb.weight, std=d**-0.5)
            pos = torch.arange(max_len, dtype=torch.float32)[:, None]
            inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(1e4) / d))
            pe = torch.zeros(max_len, d)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
            self.register_buffer('pe', pe, persistent=False)
            self.drop, self.scale = nn.Dropout(0.1), math.sqrt(d)

        def embed(self, ids):
            return self.drop(self.emb(ids) * self.scale + self.pe[: ids.shape[1]])

        def forward(
            self, src, tgt_in
        ):  # causal hint -> SDPA is_causal (flash) in the decoder self-attn
            mask = nn.Transformer.generate_square_subsequent_mask(
                tgt_in.shape[1], device=src.device
            )
            h = self.tf(self.embed(src), self.embed(tgt_in), tgt_mask=mask, tgt_is_causal=True)
            return F.linear(h, self.emb.weight)

    def sync():
        if dev == 'cuda':
            torch.cuda.synchronize()

    def train(name):
        torch._dynamo.reset()  # a fresh static-shape compile per model
        gc.collect()
        if dev == 'cuda':
            torch.cuda.empty_cache()
        d, h, ff, layers = cfg['models'][name]
        torch.manual_seed(0)
        model = NMT(d, h, ff, layers).to(dev).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        src, tgt = (torch.randint(3, V, (B, S), device=dev) for _ in range(2))
        tgt_in = torch.cat([torch.zeros_like(tgt[:, :1]), tgt[:, :-1]], 1)  # shifted right

        def loss_fn(src, tgt_in, tgt):
            logits = model(src, tgt_in)
            return F.cross_entropy(
                logits.reshape(-1, V).float(), tgt.reshape(-1), label_smoothing=0.1
            )

        box = {'fn': torch.compile(loss_fn, dynamic=False)}

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = box['fn'](src, tgt_in, tgt)
            loss.backward()
            opt.step()
            box['loss'] = loss.detach()
            sync()

        compiled, note, t0 = True, None, time.time()
        try:
            step()  # the first call compiles forward and backward
        except Exception as e:
            compiled, note = (
                False,
                f'torch.compile failed, eager fallback: {type(e).__name__}: {e}'[:300],
            )
            print(f'[torch {name}] {note}', flush=True)
            torch._dynamo.reset()
            box['fn'] = loss_fn
            step()
        compile_s = time.time() - t0
        for _ in range(cfg['warmup']):
            step()
        ts = time_runs(step, cfg['steps'])
        return dict(
            framework='torch',
            version=torch.__version__,
            model=name,
            arch='nn.Transformer post-LN',
            compiled=compiled,
            compile_s=compile_s,
            n_params=sum(p.numel() for p in model.parameters()),
            loss=box['loss'].item(),
            **train_metrics(ts, cfg, d, ff, layers),
            **({'note': note} if note else {}),
        )

    for name in ('BASE', 'BIG'):
        measure('torch', f'train_{name}', 45, functools.partial(train, name))


# HF transformers decode peer
def section_hf(cfg, tiny):
    import torch
    import transformers
    from transformers import MarianConfig, MarianMTModel

    dev = 'cpu' if tiny else 'cuda'

    def generate():
        d, h, ff, layers = cfg['models']['BASE']
        mc = MarianConfig(
            vocab_size=cfg['vocab'],
            d_model=d,
            encoder_layers=layers,
            decoder_layers=layers,
            encoder_attention_heads=h,
            decoder_attention_heads=h,
            encoder_ffn_dim=ff,
            decoder_ffn_dim=ff,
            activation_function='relu',
            max_position_embeddings=512,
            pad_token_id=0,
            decoder_start_token_id=0,
            eos_token_id=2,
            forced_eos_token_id=2,
        )
        torch.manual_seed(0)
        model = MarianMTModel(mc).to(device=dev, dtype=torch.bfloat16).eval()
        src = torch.from_numpy(decode_src(cfg)).to(dev)
        kw = dict(
            input_ids=src,
            attention_mask=torch.ones_like(src),
            num_beams=cfg['beams'],
            do_sample=False,
            max_new_tokens=cfg['dec_new'],
            min_new_tokens=cfg['dec_new'],
        )  # other generate args: HF defaults
        box = {}

        def run():
            with torch.inference_mode():
                box['out'] = model.generate(**kw)
            if dev == 'cuda':
                torch.cuda.synchronize()

        t0 = time.time()
        run()
        first_s = time.time() - t0
        ts = time_runs(run, cfg['reps'], 1)
        return dict(
            framework='hf transformers',
            version=transformers.__version__,
            model='MarianMTModel BASE shape',
            attn_impl=getattr(model.config, '_attn_implementation', None),
            decoded_len=int(box['out'].shape[1]) - 1,
            **decode_metrics(first_s, ts, cfg),
        )

    measure('hf', 'generate_BASE', 15, generate)


# JAX/Flax peer
def section_jax(cfg, tiny):
    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    if not os.path.isfile(os.path.join(benchlib.PEER_DIR, 'models.py')):
        emit(
            'jax',
            'peer_files',
            status='error',
            error=f'missing {benchlib.PEER_DIR}/models.py, decode.py (bench/README.md)',
        )
        return
    models, decode = benchlib.load_flax_peer()  # google/flax examples/wmt, verbatim

    V, B, S = cfg['vocab'], cfg['batch'], cfg['seq']
    version = f'jax {jax.__version__} flax {flax.__version__} optax {optax.__version__}'
    r = measure(
        'jax',
        'jax_info',
        0,
        lambda: dict(version=version, backend=jax.default_backend(), devices=str(jax.devices())),
    )
    if not tiny and r.get('backend') != 'gpu':
        emit(
            'jax',
            'backend_check',
            status='error',
            error=f'JAX backend is {r.get("backend")}, not gpu: section skipped',
        )
        return

    def train(name):
        gc.collect()
        d, h, ff, layers = cfg['models'][name]
        config = benchlib.flax_peer_config(models, cfg['models'][name], V, 'bfloat16',
                                           deterministic=False, decode=False)
        params = benchlib.flax_peer_params(models, config, S, S)
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
        state = benchlib.flax_peer_state(models, config, params)
        rng = np.random.default_rng(0)
        batch = {
            k: jnp.asarray(rng.integers(3, V, (B, S), dtype=np.int32))
            for k in ('inputs', 'targets')
        }
        key, t0 = jax.random.key(1), time.time()
        step_fn = jax.jit(benchlib.flax_peer_train_step(models, config), donate_argnums=(0,))
        compiled = step_fn.lower(state, batch, key).compile()
        compile_s, box = time.time() - t0, {'state': state}
        del state, params

        def step():
            box['state'], box['loss'] = compiled(box['state'], batch, key)
            jax.block_until_ready(box['state'])

        for _ in range(cfg['warmup']):
            step()
        ts = time_runs(step, cfg['steps'])
        return dict(
            framework='jax/flax',
            version=version,
            model=name,
            compile_s=compile_s,
            n_params=n_params,
            arch='flax examples/wmt: pre-LN, logits via shared embedding in f32',
            loss=float(box['loss']),
            **train_metrics(ts, cfg, d, ff, layers),
        )

    def beam():
        gc.collect()
        config = benchlib.flax_peer_config(models, cfg['models']['BASE'], V, 'bfloat16',
                                           deterministic=True, decode=True)
        max_decode_len = cfg['dec_new'] + 1  # slot 0 holds the start token
        inputs = jnp.asarray(decode_src(cfg), jnp.int32)
        params = benchlib.flax_peer_params(models, config, inputs.shape[1], max_decode_len)
        predict_step, initialize_cache = benchlib.flax_peer_predict(
            models, decode, config, cfg['beams'], max_decode_len, NO_EOS)

        init_cache, t0 = jax.jit(initialize_cache), time.time()
        cache = jax.block_until_ready(init_cache(inputs))
        cache_compile_s, t0 = time.time() - t0, time.time()
        predict = jax.jit(predict_step).lower(inputs, params, cache).compile()
        compile_s, box = time.time() - t0, {}

        def run():  # per batch as in the example: a fresh cache, then the beam search
            box['out'] = jax.block_until_ready(predict(inputs, params, init_cache(inputs)))

        t0 = time.time()
        run()
        first_s = time.time() - t0
        ts = time_runs(run, cfg['reps'], 1)
        return dict(
            framework='jax/flax',
            version=version,
            model='flax wmt BASE',
            alpha=0.6,
            compile_s=compile_s,
            cache_init_compile_s=cache_compile_s,
            decoded_len=int(box['out'].shape[1]),
            note='eos disabled: fixed decode length',
            **decode_metrics(first_s, ts, cfg),
        )

    measure('jax', 'train_BASE', 30, functools.partial(train, 'BASE'))
    measure('jax', 'train_BIG', 30, functools.partial(train, 'BIG'))
    measure('jax', 'beam_search_BASE', 30, beam)

