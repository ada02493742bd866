"""The table_copies lever on this CPU: the tiny train step's collectives and temporaries per mesh.

    python bench/table_copies.py                  # table_copies on and off, 3 meshes, both losses
    python bench/table_copies.py --copies on      # on only (a checkout older than the switch)

configs/tiny.py at 16 rows, compiled for 8 host CPU devices (no step runs): per device, the
collectives of the compiled HLO by kind (count, operand bytes; t2t/aot/hlo.py) and XLA's
temporaries. Under data parallelism the token table's copies make its three reads (both lookups,
the tied projection) one gradient reduction (t2t/tables.py); off, the textbook jnp.take and
y @ E.T, XLA reduces each read's part on its own.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                           + ' --xla_force_host_platform_device_count=8')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--copies', default='on,off', help='table_copies settings: on, off')
    parser.add_argument('--meshes', default='8,1,1 4,2,1 1,8,1', help='data,fsdp,tensor ...')
    parser.add_argument('--loss_impl', default='plain,fused')
    args = parser.parse_args()

    import jax
    import numpy as np

    from t2t import optim, sharding, train_lib
    from t2t.aot import hlo
    from tests.helpers import tiny_config

    for copies in args.copies.split(','):
        for loss_impl in args.loss_impl.split(','):
            for mesh_text in args.meshes.split():
                mesh_shape = tuple(int(n) for n in mesh_text.split(','))
                switch = {} if copies == 'on' else {'table_copies': False}  # on: the default
                config = tiny_config(batch_size=16, loss_impl=loss_impl, **switch)
                tx = optim.make_optimizer(config)
                mesh = sharding.make_mesh(mesh_shape)
                abstract = train_lib.abstract_state(config, mesh, tx)
                shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
                batch = {k: jax.ShapeDtypeStruct((config.batch_size, config.max_len), np.int32,
                                                 sharding=sharding.batch_sharding(mesh))
                         for k in ('inputs', 'targets')}
                step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx,
                                                shardings, mesh)
                compiled = step.lower(abstract, batch).compile()
                kinds = {k: f'{c.count} / {c.bytes} B' for k, c in
                         sorted(hlo.collectives(compiled.as_text()).items()) if c.count}
                print(f'table_copies={copies} loss_impl={loss_impl} mesh={mesh_text}: {kinds}, '
                      f'temporaries {compiled.memory_analysis().temp_size_in_bytes} B',
                      flush=True)


if __name__ == '__main__':
    main()
