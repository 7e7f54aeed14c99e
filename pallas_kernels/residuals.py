"""The remat name on what an attention kernel's forward keeps for its backward.

Inside `jax.checkpoint` with a names policy (the model's memory policies), a custom_vjp's
residuals survive to the backward pass only if they carry a saved name; otherwise the
backward pass runs the kernel's forward again (for the KDA kernels: the in-chunk kernel,
docs/kernel_tuning.md, "KDA in-chunk results as residuals"). The attention kernels tag
the residuals they compute with the save point of the attention core's output, so
keeping "attention" keeps everything the core's backward reads. hylora.core.save_points
takes the name from here.
"""

from jax.ad_checkpoint import checkpoint_name

NAME = "attention"


def keep(*arrays):
  """The arrays, tagged as residuals of the attention core (identity outside remat)."""
  return tuple(checkpoint_name(a, NAME) for a in arrays)
