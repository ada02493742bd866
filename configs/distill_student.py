"""A student for sequence-level distillation of the demo model (scripts/distill.py): the default
config with half the layers and a quarter of the feed-forward width. scripts/distill.py replaces
its data by the teacher's translations; trained on the references it is the baseline."""

from configs import default


def get_config():
    c = default.get_config()
    c.unlock()
    c.d_ff = 256
    c.num_encoder_layers = c.num_decoder_layers = 2
    c.lock()
    return c
