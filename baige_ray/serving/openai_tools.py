"""The `tools` of a chat request, as vLLM renders them into the model's chat template.

Each tool reaches the template as vLLM's request model dumps it (`ChatCompletionToolsParam`):
`{"type": "function", "function": {"name", "description", "parameters"}}` in that order, None where a
field is absent, `strict` and `defer_loading` only where set, unknown fields dropped. A template that
writes them with `tojson` then renders the same characters here and in `vllm serve`.

Which `tool_choice` a request may send depends on whether the app parses tool calls. Without a parser (as
`vllm serve` without `--tool-call-parser`) only "none" is taken: any other choice, "auto" included (what a
request that sends tools without a choice asks for, OpenAI's default), is a 400. With one
(`serve(engine="vllm", tool_call_parser=...)`, serving/tool_calls.py) every choice is taken.
"""

from __future__ import annotations

from typing import Any

from baige_ray.serving.requests import bad_request

MAX_TOOLS = 128


def parse_tools(payload: dict, *, parses_tool_calls: bool = False) -> tuple[dict, ...] | None:
    """The request's tools as the chat template receives them (None: none sent); a RequestError naming
    the field for a malformed one, or for a tool_choice that needs tool calls parsed where the app parses none."""
    tools, choice = payload.get("tools"), payload.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", f"tool_choice={choice!r} without 'tools': send the tools to choose from")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"'tools' must be a list of at most {MAX_TOOLS} tool objects")
    rendered = tuple(_tool(index, tool) for index, tool in enumerate(tools))
    if choice is None and rendered:
        choice, default = "auto", " (the default when tools are sent)"
    else:
        default = ""
    if parses_tool_calls:
        _check_choice(choice, rendered)
    elif choice not in (None, "none"):
        raise bad_request("tool_choice", f"tool_choice={choice!r}{default} needs tool calls read from the answer: "
                                         "serve(engine='vllm', tool_call_parser=...) reads them; this app does not "
                                         "(as `vllm serve` without --tool-call-parser); send tool_choice 'none' "
                                         "for the template to show the tools to the model")
    return rendered or None


def _check_choice(choice: Any, tools: tuple[dict, ...]) -> None:
    """A choice among "none", "auto", "required" and a named function the request sent."""
    if choice in (None, "none", "auto", "required"):
        return
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
    if function["name"] not in {tool["function"]["name"] for tool in tools}:
        raise bad_request("tool_choice", f"tool_choice names the function {function['name']!r}, which 'tools' "
                                         "does not hold")


def _tool(index: int, tool: Any) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request("tools", f"{where} must be an object of type 'function'")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("tools", f"{where}.function must be an object with a string 'name'")
    checks = (("description", str), ("parameters", dict), ("strict", bool), ("defer_loading", bool))
    for field, kind in checks:
        if function.get(field) is not None and not isinstance(function[field], kind):
            raise bad_request("tools", f"{where}.function.{field} must be a {kind.__name__}")
    if tool.get("defer_loading") is not None and not isinstance(tool["defer_loading"], bool):
        raise bad_request("tools", f"{where}.defer_loading must be a bool")
    defer = function.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")  # vLLM carries the tool's own down to its function
    rendered = {"name": function["name"], "description": function.get("description"),
                "parameters": function.get("parameters")}
    if function.get("strict") is not None:
        rendered["strict"] = function["strict"]
    if defer is not None:
        rendered["defer_loading"] = defer
    out: dict = {"type": "function", "function": rendered}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out
