"""A config's train step compiled for NVIDIA GPUs on this CPU: memory, collectives and where each
all-to-all comes from (bench/RESULTS.md, "The fsdp all-to-alls").

    JAX_PLATFORMS=cpu python bench/gpu_collectives.py --config=wmt14_ende_base --gpus=8 \
        --batch_size=1024 --mesh=1,8,1

XLA's GPU compiler for the H100 SXM target description (t2t/aot/gpu_specs/h100_sxm.txtpb; the
jax[cuda12] plugin, no GPU). attention_impl is resolved for a GPU as a dry run does
(t2t/attention_choice.py). Per device: XLA's memory_analysis, the collectives of the compiled
HLO by kind (operand bytes, loops by trip count), every all-to-all with jax's op_name, and the
HLO's matmul FLOPs and memory traffic (t2t/aot/hlo.py, t2t/aot/memory.py).
"""

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPEC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    't2t', 'aot', 'gpu_specs', 'h100_sxm.txtpb')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='wmt14_ende_base', help='a module of configs/')
    parser.add_argument('--gpus', type=int, default=8, help='GPUs of one node')
    parser.add_argument('--batch_size', type=int, default=1024)
    parser.add_argument('--mesh', default='1,8,1', help='data,fsdp,tensor')
    args = parser.parse_args()

    import jax
    from jax.experimental import topologies

    from t2t import attention_choice, optim, sharding, train_lib
    from t2t.aot import hlo
    from t2t.aot import memory as hlo_memory
    from t2t.aot import tpu as aot

    config = importlib.import_module(f'configs.{args.config}').get_config()
    config.batch_size = args.batch_size
    config.mesh_shape = tuple(int(n) for n in args.mesh.split(','))
    config.attention_impl = attention_choice.resolve_attention_impl(config, 'gpu')[0]
    with open(SPEC) as f:
        topology = topologies.get_topology_desc(platform='cuda', topology=f'1x1x{args.gpus}',
                                                target_config=f.read())
    mesh = sharding.make_mesh(config.mesh_shape, devices=topology.devices)
    tx = optim.make_optimizer(config)
    state = train_lib.abstract_state(config, mesh, tx)
    step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx,
                                    jax.tree_util.tree_map(lambda x: x.sharding, state), mesh)
    start = time.perf_counter()
    compiled = step.lower(state, aot.abstract_batch(config, mesh)).compile()
    print(f'{args.config}, {args.batch_size} rows x {config.max_len}, mesh {config.mesh_shape} '
          f'on {args.gpus} H100 (compiled on this CPU in {time.perf_counter() - start:.0f} s), '
          f'attention_impl {config.attention_impl}')
    m = aot.Memory.of(compiled)
    print(f'memory per device: arguments {m.arguments / 2**30:.3f} GiB, temporaries '
          f'{m.temporaries / 2**30:.3f} GiB, total {m.total / 2**30:.3f} GiB')
    module = hlo.parse(compiled.as_text())
    kinds = {kind: c.bytes + c.in_loops_bytes for kind, c in hlo.collectives(module).items()
             if c.count or c.in_loops_count}
    print(f'collectives per device per step: {sum(kinds.values()) / 1e6:.1f} MB ('
          + ', '.join(f'{kind} {b / 1e6:.1f} MB' for kind, b in kinds.items()) + ')')
    for op in hlo.collective_ops(module):
        if op.kind == 'all-to-all':
            print(f'  all-to-all {", ".join(op.operand_shapes)} {op.bytes / 1e6:.1f} MB: '
                  f'{op.op_name}')
    print(f'matmul FLOPs per device {hlo.matmul_flops(module):.4g}; memory traffic per device '
          f'{hlo_memory.memory_bytes(module) / 1e9:.2f} GB (t2t/aot/memory.py)')


if __name__ == '__main__':
    main()
