"""Image + text conversation data: JSONL records -> tokenised, loss-masked examples ->
packed rows with per-row image tiles, in a seeded, resumable, host-sharded order."""

from hylora.data.chat import TEMPLATES, ChatTemplate, ChatTokenizer
from hylora.data.loader import ConversationLoader
from hylora.data.records import is_conversation_file

__all__ = ["ChatTemplate", "ChatTokenizer", "ConversationLoader", "TEMPLATES",
           "is_conversation_file"]
