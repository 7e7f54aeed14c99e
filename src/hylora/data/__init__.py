"""Training data, one stream whatever the source (`stream.open_stream`): token documents
packed into rows (`sources.py`), or image + text conversations: JSONL records ->
tokenised, loss-masked examples -> packed rows with per-row image tiles, in a seeded,
resumable, host-sharded order (`loader.py`)."""

from hylora.data.chat import TEMPLATES, ChatTemplate, ChatTokenizer
from hylora.data.loader import ConversationLoader
from hylora.data.records import is_conversation_file
from hylora.data.stream import TokenStream, open_stream

__all__ = [
    "ChatTemplate", "ChatTokenizer", "ConversationLoader", "TEMPLATES", "TokenStream",
    "is_conversation_file", "open_stream"
]
