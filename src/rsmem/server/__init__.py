"""The OpenAI-compatible server (``rsmem serve``): ``run_server(llm, ServeOptions(...))``."""

from rsmem.server.app import create_app
from rsmem.server.chat import ChatTemplate, load_chat_template
from rsmem.server.launch import ServeOptions, ServerApp, bind_socket, build_app, run_server
from rsmem.server.runner import EngineRunner
from rsmem.server.state import AppState, ServerSettings

__all__ = [
    "AppState",
    "ChatTemplate",
    "EngineRunner",
    "ServeOptions",
    "ServerApp",
    "ServerSettings",
    "bind_socket",
    "build_app",
    "create_app",
    "load_chat_template",
    "run_server",
]
