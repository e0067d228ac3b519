"""The OpenAI-compatible server (``rsmem serve``)."""

from rsmem.server.app import ServerSettings, create_app
from rsmem.server.chat import ChatTemplate, load_chat_template
from rsmem.server.runner import EngineRunner

__all__ = ["ChatTemplate", "EngineRunner", "ServerSettings", "create_app", "load_chat_template"]
