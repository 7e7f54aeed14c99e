"""Kimi K3's block attention residuals ("block_attention"): a five-layer model with blocks of
two (starts at layers 0, 2 and 4; one scanned segment per block) against a numpy
re-implementation of KimiK3DecoderLayer's residual flow around the model's own mixers and
FFNs, in fp32; the segmented scan's outputs and gradients against the same flow unrolled
in JAX, also for a block size that is not a multiple of the pattern's period."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hylora.model import ForwardContext, HybridLM
from hylora.model.init import ParamInit
from hylora.model.residual import BlockAttentionResidual
from tests.helpers import small_config

B, T, LAYERS, BLOCK = 2, 16, 5, 2


def _model_config(layers=LAYERS, block=BLOCK, pattern=("linear", "linear")):
  m = small_config().model
  # Periods of two layers, blocks of two: one segment per block, the last the fifth layer.
  return dataclasses.replace(m, layers=layers, pattern=pattern, dense_layers=layers,
                             residual="block_attention", residual_block=block,
                             weight_dtype="float32",
                             vision=dataclasses.replace(m.vision, enabled=False))


def _model(m=None):
  m = m or _model_config()

  def build():
    model = HybridLM(m, None, init=ParamInit(0))
    # Trained-looking queries and norms: every block's weight in the softmax matters.
    init = ParamInit(7)
    for path, leaf in nnx.iter_graph(model):
      if "residual" in "/".join(map(str, path)) and isinstance(leaf, nnx.Param):
        base = 1.0 if path[-1] in ("mixer_norm", "ffn_norm", "norm") else 0.0
        leaf[...] = base + init.normal(leaf.shape, 0.5)
    return model

  return m, nnx.jit(build)()


def _layers(model):
  """The decoder layers in order, unstacked from the scanned segments."""
  out = []
  for segment in model.stack.segments:
    graphdef, state = nnx.split(segment.periods)
    for r in range(segment.repeats):
      period = nnx.merge(graphdef, jax.tree.map(lambda a, r=r: a[r], state))
      out.extend(period.layers)
  return out


def _attention_residual(partial, blocks, norm, query, eps):
  """softmax over the values (blocks..., partial) of query . RMSNorm(value), float64."""
  values = np.stack(blocks + [partial])  # [N, ..., d]
  normed = values / np.sqrt(np.mean(values**2, axis=-1, keepdims=True) + eps) * norm
  scores = normed @ query  # [N, ...]
  probs = np.exp(scores - scores.max(0))
  probs /= probs.sum(0)
  return np.sum(probs[..., None] * values, axis=0)


def _numpy_flow(model, m, tokens, ctx, block=BLOCK):
  """KimiK3DecoderLayer's residual bookkeeping, layer by layer; the mixers and FFNs are
  the model's (run in JAX), everything between them numpy."""
  f64 = lambda a: np.asarray(a, np.float64)
  run = nnx.jit(lambda part, x: part(jnp.asarray(x, jnp.float32), ctx)[0])
  norm = nnx.jit(lambda n, x: n(jnp.asarray(x, jnp.float32)))
  hidden = f64(model.embed[...])[np.asarray(tokens)]
  blocks, eps = [], m.norm_eps
  for i, layer in enumerate(_layers(model)):
    r = layer.residual
    partial = hidden
    x = partial
    if blocks:
      x = _attention_residual(partial, blocks, f64(r.mixer_norm[...]), f64(r.mixer_query[...]), eps)
    if i % block == 0:  # a block starts: the partial sum closes the previous block
      blocks.append(partial)
      partial = None
    attn = f64(run(layer.mixer, norm(layer.mixer_norm, x)))
    partial = attn if partial is None else partial + attn
    y = _attention_residual(partial, blocks, f64(r.ffn_norm[...]), f64(r.ffn_query[...]), eps)
    hidden = partial + f64(run(layer.ffn, norm(layer.ffn_norm, y)))
  out = model.output_residual
  hidden = _attention_residual(hidden, blocks, f64(out.norm[...]), f64(out.query[...]), eps)
  assert len(blocks) == -(-m.layers // block)  # the embedding, then each closed block
  return f64(norm(model.final_norm, hidden))


def _reference_hidden(model, m, tokens, ctx):
  """The same flow unrolled in JAX over the unstacked layers (no scan, no segments): the
  reference the segmented model's gradients are checked against."""

  def read(partial, blocks, norm, query):
    values = jnp.stack(blocks + [partial])
    normed = values * jax.lax.rsqrt(jnp.mean(values**2, axis=-1, keepdims=True) + m.norm_eps)
    probs = jax.nn.softmax((normed * norm) @ query, axis=0)
    return jnp.sum(probs[..., None] * values, axis=0)

  hidden = jnp.take(model.embed[...], tokens, axis=0)
  blocks = []
  for i, layer in enumerate(_layers(model)):
    r = layer.residual
    partial = hidden
    x = read(partial, blocks, r.mixer_norm[...], r.mixer_query[...]) if blocks else partial
    if i % m.residual_block == 0:
      blocks.append(partial)
      partial = None
    attn = layer.mixer(layer.mixer_norm(x), ctx)[0]
    partial = attn if partial is None else partial + attn
    y = read(partial, blocks, r.ffn_norm[...], r.ffn_query[...])
    hidden = partial + layer.ffn(layer.ffn_norm(y), ctx)[0]
  out = model.output_residual
  return model.final_norm(read(hidden, blocks, out.norm[...], out.query[...]))


@pytest.fixture(scope="module")
def case():
  m, model = _model()
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, m.vocab_size)
  ctx = ForwardContext(jnp.ones((B, T), jnp.int32), jnp.tile(jnp.arange(T), (B, 1)))
  return m, model, tokens, ctx


def test_model_matches_the_published_residual_flow(case):
  m, model, tokens, ctx = case
  got, _ = nnx.jit(lambda model, t: model.hidden(t, ctx))(model, tokens)
  want = _numpy_flow(model, m, tokens, ctx)
  err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
  assert err < 3e-5, err  # fp32 through five layers


def test_parameters_and_stream():
  m = _model_config()
  model = nnx.eval_shape(lambda: HybridLM(m, None, init=ParamInit(0)))
  # One segment per block: layers 0-1, 2-3 (one period each) and 4.
  assert [(s.period_len, s.repeats) for s in model.stack.segments] == [(2, 1), (2, 1), (1, 1)]
  residual = model.stack.segments[0].periods.layers[0].residual  # stacked over 1 period
  for name in ("mixer_norm", "mixer_query", "ffn_norm", "ffn_query"):
    leaf = getattr(residual, name)
    assert isinstance(leaf, nnx.Param) and leaf.shape == (1, m.d_model)
    assert leaf.dtype == jnp.float32
  assert model.output_residual.norm.shape == model.output_residual.query.shape == (m.d_model,)
  x = jnp.ones((B, T, m.d_model), jnp.bfloat16)
  stream = BlockAttentionResidual.start(m, x)
  assert stream[0] is x and stream[1] == () and int(stream[2]) == 0
  # A block start: the partial sum joins the blocks (fp32) and restarts from zeros; only
  # (partial, layer) is carried through the scan.
  partial, blocks, layer_index = BlockAttentionResidual.enter(m, stream, 0)
  assert len(blocks) == 1 and blocks[0].dtype == jnp.float32 and not np.any(np.asarray(partial))
  carried, fixed = BlockAttentionResidual.split((partial, blocks, layer_index))
  assert fixed is blocks and carried[0] is partial
  assert BlockAttentionResidual.enter(m, stream, 1) is stream  # not a block start


def test_first_layer_reads_the_embeddings_exactly():
  m = _model_config()
  residual = BlockAttentionResidual(m, init=ParamInit(0))
  residual.mixer_query[...] = jnp.full((m.d_model,), 3.0)
  x = jax.random.normal(jax.random.key(1), (B, T, m.d_model), jnp.bfloat16)
  stream = BlockAttentionResidual.enter(m, BlockAttentionResidual.start(m, x), 0)
  np.testing.assert_array_equal(residual.block_input(stream, None), x)
  # Layer 0 starts a block: its FFN reads a mix of the embeddings and the mixer's output.
  h = jnp.ones_like(x)
  carry, y = residual.ffn_input(stream, x, h, None)
  np.testing.assert_array_equal(carry, h)
  partial, blocks, layer_index = residual.update(stream, carry + h)
  assert len(blocks) == 1 and int(layer_index) == 1
  np.testing.assert_array_equal(blocks[0], x.astype(jnp.float32))


# (layers, block, pattern): blocks of three over periods of two (segments of a period and
# a single layer, the periods rotated); blocks that align with the periods are the
# published-flow test's model above. Five layers hold every kind of segment (the period,
# the single layer, the rotated period) and compile in less time than more blocks would.
SEGMENTED = [(5, 3, ("linear", "sparse"))]


@pytest.mark.parametrize("layers,block,pattern", SEGMENTED)
def test_segmented_scan_matches_the_unrolled_flow(layers, block, pattern):
  m, model = _model(_model_config(layers, block, pattern))
  kinds = [mixer for mixer, _ in m.layer_kinds()]
  first = 0
  for segment in model.stack.segments:  # no segment crosses a block start
    span = segment.period_len * segment.repeats
    assert all(i % block for i in range(first + 1, first + span))
    assert [l.mixer.__class__ for l in segment.periods.layers
           ] == [l.mixer.__class__ for l in _layers(model)[first:first + segment.period_len]]
    first += span
  assert first == layers and len(kinds) == layers
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, m.vocab_size)
  ctx = ForwardContext(jnp.ones((B, T), jnp.int32), jnp.tile(jnp.arange(T), (B, 1)))
  weights = jax.random.normal(jax.random.key(2), (B, T, m.d_model), jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, reference):
    model = nnx.merge(graphdef, params, rest)
    if reference:
      hidden = _reference_hidden(model, m, tokens, ctx)
    else:
      hidden, _ = model.hidden(tokens, ctx)
    return jnp.sum(hidden * weights), hidden

  grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)
  (got, got_hidden), (want, want_hidden) = grad(params, False), grad(params, True)
  scale = np.abs(np.asarray(want_hidden)).max()
  assert np.abs(np.asarray(got_hidden - want_hidden)).max() < 3e-5 * scale
  want_flow = _numpy_flow(model, m, tokens, ctx, block)
  assert np.abs(np.asarray(got_hidden, np.float64) - want_flow).max() < 3e-5 * scale
  reached = 0
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    if path[0].key == "lm_head":  # not part of the hidden state
      continue
    g, w = np.asarray(g), np.asarray(w)
    # (layer 0's mixer read has one value, the embedding: its query gets no gradient)
    assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max(), path
    reached += np.abs(w).max() > 0
  # (the sparse indexer's weights get none: its top-K selection is not differentiated)
  assert reached > len(jax.tree.leaves(want)) // 2
