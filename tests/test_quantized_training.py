"""A packed frozen base trains as its bf16 twin: for every packed format, the tiny
quantized checkpoint loaded into the packed model gives the same loss and LoRA gradients
as the twin checkpoint whose tensors are the dequantized values, loaded into the bf16
model. Each model has two layers, a dense FFN and the routed experts (the house model's and
DeepSeek-V3.2's every layer kind; Kimi K3's MLA layer, which MXFP4 leaves unpacked, left
out): packing does not depend on depth."""

import numpy as np
import pytest

import quant_helpers as qh
from helpers import loss_and_lora_grads, token_batch
from hylora.io import hf_weights
from hylora.io.hf_names import packed_formats
from hylora.quant.packed_weight import is_packed
from hylora.train import state as st


@pytest.mark.parametrize("fmt", qh.FORMATS)
def test_packed_base_trains_like_its_bf16_twin(fmt, tmp_path):
  q = qh.build(fmt, layers=2)
  parts = st.model_parts(q.cfg)
  _, frozen_abstract = st.abstract_arrays(parts, q.mesh)
  held = {p for p, v in hf_weights.flat_paths(frozen_abstract).items() if is_packed(v)}
  # the model packs exactly the linears the checkpoint ships packed
  assert held and held == set(packed_formats(q.cfg, q.frozen_bf16))
  folder = qh.write_folder(q, tmp_path / "packed")
  twin_folder = qh.write_folder(q, tmp_path / "twin", twin=True)
  frozen, _ = hf_weights.load(folder, q.cfg, frozen_abstract)
  twin, _ = hf_weights.load(twin_folder, qh.bf16_twin(q.cfg), q.frozen_bf16)
  batch = token_batch(q.cfg, q.mesh)
  loss, grads = loss_and_lora_grads(q.cfg, q.mesh, q.lora, frozen, batch)
  twin_loss, twin_grads = loss_and_lora_grads(qh.bf16_twin(q.cfg), q.mesh, q.lora, twin, batch)
  assert np.isfinite(loss) and abs(loss - twin_loss) <= 1e-3 * abs(twin_loss), (loss, twin_loss)
  flat, twin_flat = hf_weights.flat_paths(grads), hf_weights.flat_paths(twin_grads)
  assert set(flat) == set(twin_flat)
  for path, g in flat.items():
    want = np.asarray(twin_flat[path], np.float32)
    scale = np.abs(want).max() or 1.0
    np.testing.assert_allclose(np.asarray(g, np.float32), want, atol=2e-2 * scale,
                               err_msg=str(path))
