"""Conversations from agent-trajectory files: τ²-bench results JSON and OpenAI-chat JSONL.

Each source turns a file into :class:`Conversation` objects: OpenAI chat ``messages`` (the
system prompt first when there is one; assistant ``tool_calls`` as ``{"id", "type":
"function", "function": {"name", "arguments"}}``; ``tool`` messages with ``tool_call_id``;
reasoning as ``reasoning_content``), the ``tools`` the agent saw, the episode's reward, its
group and which assistant messages the harness wrote rather than the model (context, not
training records).

* ``tau2``: a τ²-bench results file (``info``, ``simulations[]`` with ``messages``,
  ``task_id``, ``reward_info.reward``). The system prompt is τ²'s agent prompt (its
  ``LLMAgent`` instruction and the domain policy from ``info.environment_info.policy``), the
  tools the domain's agent tools (``info.environment_info.tool_defs`` when the file has them,
  else the schemas bundled in ``dta/data/tau2``). The agent sees what τ²'s orchestrator shows
  it: the user's tool calls and their results (telecom) are the user's, not the agent's. The
  first message, τ²'s fixed greeting, is context. group = ``task_id``.
* ``openai``: JSONL, one conversation per line: ``{"messages": [...], "tools": [...],
  "reward": r, "group_id": g, "id": e}`` (all but ``messages`` optional). Every assistant
  message is a record.

Bad input is a :class:`ImportError_` naming the file, the conversation and the message.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dta.records.fields import BatchError

__all__ = ["ImportError_", "Conversation", "SOURCES", "read_conversations", "tau2_system_prompt"]

DATA = Path(__file__).resolve().parent.parent / "data" / "tau2"
ROLES = ("system", "user", "assistant", "tool")
OPENAI_FIELDS = ("messages", "tools", "reward", "group_id", "id")
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content",
                  "reasoning")


class ImportError_(BatchError):
    """Bad conversation input; the message names the file, conversation and message."""


@dataclass
class Conversation:
    where: str  # "<file> simulation 3 (task 16)" / "<file> line 4": names it in errors
    episode: str | int
    group_id: str | int | None
    reward: float | None
    messages: list[dict]
    tools: list | None = None
    context: set = field(default_factory=set)  # assistant messages the model did not generate
    source_index: list | None = None  # each message's index in the source (None: added here)

    def generated(self) -> list[int]:
        """Indices of the assistant messages that become records."""
        return [i for i, m in enumerate(self.messages)
                if m["role"] == "assistant" and i not in self.context]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _text(content, where: str) -> str:
    """Message content as text: a string, None (empty) or OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ImportError_(f"{where}: content must be a string or a list of text parts, got "
                       f"{type(content).__name__}")


def _tool_call(call, where: str) -> dict:
    if not isinstance(call, dict):
        raise ImportError_(f"{where}: a tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)  # OpenAI nests name/arguments under "function"; τ² does not
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ImportError_(f"{where}: a tool call without a function name")
    args = fn.get("arguments", {})
    if not isinstance(args, (dict, str)):
        raise ImportError_(f"{where}: tool call {fn['name']!r}: arguments must be an object or "
                           f"a JSON string, got {type(args).__name__}")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def _message(m, where: str, reasoning_key: str) -> dict:
    """One OpenAI chat message, checked and normalized."""
    if not isinstance(m, dict):
        raise ImportError_(f"{where}: expected an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise ImportError_(f"{where}: unknown role {role!r}; a message's role is one of "
                           f"{', '.join(ROLES)}")
    out = {"role": role, "content": _text(m.get("content"), where)}
    if role == "assistant":
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ImportError_(f"{where}: tool_calls must be a list")
        if calls:
            out["tool_calls"] = [_tool_call(c, where) for c in calls]
        reasoning = m.get(reasoning_key)
        if reasoning is not None and not isinstance(reasoning, str):
            raise ImportError_(f"{where}: {reasoning_key} must be a string")
        if reasoning:
            out["reasoning_content"] = reasoning
    elif m.get("tool_calls"):
        raise ImportError_(f"{where}: a {role} message with tool_calls (only the assistant calls "
                           "tools)")
    if role == "tool":
        call_id = m.get("tool_call_id", m.get("id"))
        if call_id is not None:
            out["tool_call_id"] = str(call_id)
    if role in ("user", "tool") and m.get("name") is not None:
        out["name"] = str(m["name"])
    return out


# --- τ²-bench results --------------------------------------------------------------------

def tau2_system_prompt(policy: str) -> str:
    """τ²'s ``LLMAgent`` system prompt for a domain policy."""
    instruction = (DATA / "agent_instruction.txt").read_text(encoding="utf-8")
    return (f"<instructions>\n{instruction}\n</instructions>\n<policy>\n{policy}\n"
            "</policy>")


def tau2_tools(domain: str, where: str) -> list:
    schemas = json.loads((DATA / "tool_schemas_openai.json").read_text(encoding="utf-8"))
    if domain not in schemas:
        raise ImportError_(f"{where}: no tool schemas for τ² domain {domain!r} (known: "
                           f"{', '.join(schemas)})")
    return schemas[domain]["agent"]


def _load_json(path: str, fmt: str, other: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise ImportError_(f"{path}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ImportError_(f"{path}: not a {fmt} file: bad JSON ({e.msg} at line {e.lineno} "
                           f"column {e.colno}); {other}") from None


def _tau2_agent_view(raw: list, where: str) -> tuple[list[dict], set, list]:
    """The messages τ²'s agent saw (after the system prompt), the greeting's index as
    context, and each message's index in the file."""
    msgs, context, index = [], set(), [None]
    if not isinstance(raw, list):
        raise ImportError_(f"{where}: 'messages' must be a list")
    for j, m in enumerate(raw):
        at = f"{where} message {j}"
        if not isinstance(m, dict):
            raise ImportError_(f"{at}: expected an object, got {type(m).__name__}")
        role = m.get("role")
        if role == "tool" and m.get("requestor") == "user":
            continue  # the user's own tool (telecom): shown to the user, not to the agent
        if role == "user" and m.get("tool_calls"):
            if not m.get("content"):
                continue
            m = {k: v for k, v in m.items() if k != "tool_calls"}
        msg = _message({k: m.get(k) for k in ("role", "content", "tool_calls", "reasoning", "id")
                        if k in m}, at, "reasoning")
        if role == "assistant" and not msgs and j == 0:
            context.add(len(msgs) + 1)  # τ²'s fixed greeting (index after the system prompt)
        msgs.append(msg)
        index.append(j)
    return msgs, context, index


def read_tau2(path: str) -> list[Conversation]:
    data = _load_json(path, "τ²-bench results", "--from openai reads JSONL, one conversation "
                                                 "per line")
    if not isinstance(data, dict) or not isinstance(data.get("simulations"), list):
        raise ImportError_(f"{path}: not a τ²-bench results file (no 'simulations' list at the "
                           "top); is it --from openai?")
    env = (data.get("info") or {}).get("environment_info") or {}
    policy, domain = env.get("policy"), env.get("domain_name")
    if not isinstance(policy, str) or not isinstance(domain, str):
        raise ImportError_(f"{path}: info.environment_info has no 'policy' / 'domain_name' "
                           "(the agent's system prompt comes from them)")
    tools = env.get("tool_defs")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and "function" in t for t in tools)):
        tools = None  # τ²'s own tool definitions, not OpenAI schemas: use the bundled ones
    tools = tools or tau2_tools(domain, path)
    system = {"role": "system", "content": tau2_system_prompt(policy)}
    out = []
    for i, sim in enumerate(data["simulations"]):
        if not isinstance(sim, dict):
            raise ImportError_(f"{path} simulation {i}: expected an object")
        task = sim.get("task_id")
        where = f"{path} simulation {i} (task {task})"
        if not isinstance(task, (str, int)) or isinstance(task, bool):
            raise ImportError_(f"{where}: 'task_id' missing or not a string")
        info = sim.get("reward_info")
        reward = info.get("reward") if isinstance(info, dict) else None
        if reward is not None and not _is_number(reward):
            raise ImportError_(f"{where}: reward_info.reward is {reward!r}, expected a number")
        msgs, context, index = _tau2_agent_view(sim.get("messages"), where)
        out.append(Conversation(where=where, episode=str(sim.get("id", i)), group_id=task,
                                reward=None if reward is None else float(reward),
                                messages=[system] + msgs, tools=tools, context=context,
                                source_index=index))
    return out


# --- OpenAI chat JSONL -------------------------------------------------------------------

def read_openai(path: str) -> list[Conversation]:
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ImportError_(f"{where}: not UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ImportError_(f"{where}: not OpenAI-chat JSONL: bad JSON ({e.msg} at "
                                   f"column {e.colno}); a τ²-bench results file is --from "
                                   "tau2") from None
            if not isinstance(obj, dict):
                raise ImportError_(f"{where}: expected one conversation object per line, got "
                                   f"{type(obj).__name__}")
            if "simulations" in obj:
                raise ImportError_(f"{where}: this is a τ²-bench results file; use --from tau2")
            for key in obj:
                if key not in OPENAI_FIELDS:
                    raise ImportError_(f"{where}: unknown field {key!r}; a conversation has "
                                       f"{', '.join(OPENAI_FIELDS)}")
            episode = obj.get("id", lineno)
            where = f"{path} line {lineno} (conversation {episode})"
            msgs = obj.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ImportError_(f"{where}: 'messages' must be a non-empty list")
            checked = []
            for j, m in enumerate(msgs):
                at = f"{where} message {j}"
                if isinstance(m, dict):
                    for key in m:
                        if key not in MESSAGE_FIELDS:
                            raise ImportError_(f"{at}: unknown field {key!r}; a message has "
                                               f"{', '.join(MESSAGE_FIELDS)}")
                    if "reasoning" in m and "reasoning_content" in m:
                        raise ImportError_(f"{at}: give one of reasoning / reasoning_content")
                key = ("reasoning" if isinstance(m, dict) and "reasoning" in m
                       else "reasoning_content")
                checked.append(_message(m, at, key))
            tools = obj.get("tools")
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict)
                                                                            for t in tools)):
                raise ImportError_(f"{where}: 'tools' must be a list of tool schemas")
            reward = obj.get("reward")
            if reward is not None and not _is_number(reward):
                raise ImportError_(f"{where}: reward is {reward!r}, expected a number")
            group = obj.get("group_id")
            if group is not None and (isinstance(group, bool) or not isinstance(group, (int, str))):
                raise ImportError_(f"{where}: group_id must be an int or a string")
            if isinstance(episode, bool) or not isinstance(episode, (int, str)):
                raise ImportError_(f"{where}: id must be an int or a string")
            out.append(Conversation(where=where, episode=episode, group_id=group,
                                    reward=None if reward is None else float(reward),
                                    messages=checked, tools=tools or None))
    return out


SOURCES = {"tau2": read_tau2, "openai": read_openai}


def read_conversations(source: str, path: str | os.PathLike) -> list[Conversation]:
    """The conversations of ``path`` read as ``source`` (``tau2`` | ``openai``)."""
    if source not in SOURCES:
        raise ImportError_(f"unknown source {source!r}; choose from {', '.join(SOURCES)}")
    from dta.paths import check_path

    path = check_path(path, "file", f"--from {source} FILE", error=ImportError_)
    convs = SOURCES[source](path)
    if not convs:
        raise ImportError_(f"{path}: no conversations")
    return convs
