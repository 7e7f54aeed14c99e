"""The one vocabulary of logical axis names.

Parameters and key activations name their dimensions with these; `meshes.rules` maps
them onto the physical mesh `(fsdp, expert)`.
"""

BATCH = "batch"
SEQ = "seq"
EMBED = "embed"  # the model width d
HEADS = "heads"  # query heads (and linear-attention heads)
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"  # dense / shared-expert FFN width (gate_up holds 2 x mlp)
EXP = "exp"  # routed experts
EXP_MLP = "exp_mlp"  # a routed expert's FFN width
VOCAB = "vocab"
LORA_RANK = "lora_rank"
LOW_RANK = "low_rank"  # inner width of low-rank projections (gates, indexer query)
INDEX_HEADS = "index_heads"
LAYERS = "layers"  # the stacked-layer axis of a scanned segment; never sharded
TOKENS = "tokens"  # flattened batch x seq rows (MoE dispatch)

ALL = (BATCH, SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, EXP, EXP_MLP, VOCAB, LORA_RANK, LOW_RANK,
       INDEX_HEADS, LAYERS, TOKENS)
