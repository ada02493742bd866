"""`train.py --dry_run`: the abstract model of a config (no compile, no data), counted and costed.

The TPU ahead-of-time report (`--dry_run --topology`) is t2t/aot/report.py."""

from __future__ import annotations

from t2t.infra import flops
from t2t.model import TransformerConfig, abstract_params, count_params


def summarize(config) -> str:
    """Lines of the dry-run report; includes `params: N` and the FLOPs of one training step."""
    model_config = TransformerConfig.from_config(config)
    params = abstract_params(model_config)
    total_flops = flops.config_flops_per_step(config)
    tokens = config.batch_size * config.max_len
    lines = [
        f'model: d_model={config.d_model} d_ff={config.d_ff} heads={config.num_heads} '
        f'layers={config.num_encoder_layers}+{config.num_decoder_layers} vocab={config.vocab_size} '
        f'{"pre-LN" if config.pre_ln else "post-LN"} positions={config.position_embedding} '
        f'dtype={config.dtype} attention={config.attention_impl}',
        f'params: {count_params(params)}',
    ]
    for name in sorted(params):
        lines.append(f'  {name}: {count_params(params[name])}')
    lines += [
        f'batch: {config.batch_size} rows x {config.max_len} tokens per side '
        f'(at most {tokens} target tokens per step)',
        f'train_flops_per_step: {total_flops:.4g}',
        f'train_flops_per_target_token: {total_flops / tokens:.4g}',
    ]
    return '\n'.join(lines)
