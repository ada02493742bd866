"""The paper's Table 3 (variations on the base model) in miniature: configs/default.py's model on
the embedded trans-de-en corpus, one change per point, the same time budget for every point.

    python sweep.py --config=configs/table3_mini.py --workdir=workdirs/table3 --split=validation

Row groups (the paper's Table 3 letters): (A) heads 1 / 4 / 8 / 16 at equal d_model, so the head
dimension d_k = d_v shrinks 128 / 32 / 16 / 8, which is also (B)'s smaller d_k; no 1/sqrt(d_k)
scaling (section 3.2.1); (E) learned instead of sinusoidal positions, and no positions at all;
post-LN (the paper) against pre-LN, each at the default and at twice the learning rate; (D)
label smoothing 0 against 0.1 and dropout 0 / 0.1 / 0.3. The default point runs once.

13 points at 300 s each (start-up, compiles and validation included: about 600 steps of the
default model on a quiet 2-core CPU), plus about 40 s a point for the final beam-search
evaluation on the validation split: about 75 minutes in all.
"""

from configs import default
from t2t.sweep import points

BUDGET_S = 300.0


def get_config():
    c = default.get_config()
    c.num_train_steps = 100_000  # the time budget ends every point (the demo's 1200 steps do not)
    c.train_time_budget_s = BUDGET_S
    return c


def get_sweep():
    lr = default.get_config().learning_rate_scale
    return [
        {},  # the default model: 4 heads, d_k 32, sinusoidal, post-LN, smoothing 0.1, dropout 0.1
        *points.product(num_heads=[1, 8, 16]),  # (A), (B): d_k = 128 / 16 / 8
        {'scale_attention': False},
        *points.product(position_embedding=['learned', 'none']),  # (E)
        {'pre_ln': True},  # post-LN (the paper) vs pre-LN, then both at twice the learning rate
        {'learning_rate_scale': 2 * lr},
        {'pre_ln': True, 'learning_rate_scale': 2 * lr},
        {'label_smoothing': 0.0},  # (D)
        *points.product(dropout_rate=[0.0, 0.3]),  # (D)
    ]
