"""Build ``airline_4trials_small_model_turns.json``: a τ²-bench results file (the layout of τ²'s
multi-trial results and leaderboard submissions: ``info.num_trials`` 4, ``simulations[]`` with
``task_id`` and ``trial``) holding the turns small models emit.

Built, not cut: it starts from the committed real results ``examples/tau2/gpt-4.1_airline_
default_gpt-4.1_1trials.json`` (MIT, Sierra Research): its ``info`` (the airline policy), three
of its tasks and their real simulations (trial 0, ``raw_data`` emptied to keep the file small).
Trials 1-3 of each task replay the same conversation (the user simulator runs at temperature
0, so a group shares its first user message) with agent turns of the kinds a small model
writes and τ²'s harness flags in ``errors``:

* trial 1: the first reply is an empty message (no content, no tool call); the user asks
  again, then the real conversation goes on;
* trial 2: the first tool call carries text as well (text + tool call), and after the first
  tool result the agent sends a whitespace-only message, which the user answers;
* trial 3: every tool call carries text, and the episode ends on an empty agent message.

The simulations come trial by trial, each trial over the three tasks, as τ²'s runner writes
them (a group's episodes are not next to each other in the file).

Run from the repository root: ``python tests/data/tau2_small_models/make_fixture.py``
(deterministic: the same file every time).
"""
import copy
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "examples" / "tau2" / "gpt-4.1_airline_default_gpt-4.1_1trials.json"
OUT = Path(__file__).resolve().parent / "airline_4trials_small_model_turns.json"
SIMULATIONS = (0, 1, 18)  # tasks 13, 6 and 48: short conversations with tool calls

EMPTY = ("You sent an empty message. Each message must contain either a text content (message "
         "to the user) or tool calls (actions to perform). Message cannot contain both or be "
         "empty.")
BOTH = ("You sent a message with both text content and tool calls. Each message must contain "
        "either a text content (message to the user) or tool calls (actions to perform). "
        "Message cannot contain both or be empty.")
NUDGE = "Hello? I did not get an answer. Could you help me with my request, please?"
STILL = "Are you still there? Did you find anything?"


def _agent(content, errors=None):
    return {"role": "assistant", "content": content, "tool_calls": None, "reasoning": None,
            "turn_idx": None, "timestamp": None, "cost": 0.0, "usage": None, "raw_data": None,
            "errors": errors}


def _user(content):
    m = _agent(content)
    m["role"] = "user"
    return m


def _texted(m, text):
    m = copy.deepcopy(m)
    m["content"], m["errors"] = text, [BOTH]
    return m


def _trials(sim):
    msgs = [dict(m, raw_data=None) for m in sim["messages"]]
    first_call = next(j for j, m in enumerate(msgs) if m["role"] == "assistant" and m.get(
        "tool_calls"))
    first_tool = next(j for j, m in enumerate(msgs) if m["role"] == "tool")
    one = msgs[:2] + [_agent(None, [EMPTY]), _user(NUDGE)] + msgs[2:]
    two = (msgs[:first_call] + [_texted(msgs[first_call], "Let me look that up for you.")]
           + msgs[first_call + 1:first_tool + 1] + [_agent("\n\n", [EMPTY]), _user(STILL)]
           + msgs[first_tool + 1:])
    three = [_texted(m, "One moment, please.") if m["role"] == "assistant" and m.get(
        "tool_calls") else m for m in msgs]
    last_user = max(j for j, m in enumerate(three) if m["role"] == "user")
    three = three[:last_user + 1] + [_agent("", [EMPTY])]
    return [msgs, one, two, three]


def main():
    data = json.loads(SRC.read_text(encoding="utf-8"))
    sims = [data["simulations"][k] for k in SIMULATIONS]
    tasks = {s["task_id"] for s in sims}
    out_sims = []
    for sim in sims:
        for trial, msgs in enumerate(_trials(sim)):
            for j, m in enumerate(msgs):
                m["turn_idx"] = j
            s = {k: v for k, v in sim.items() if k != "messages"}
            s.update(id=f"{sim['id']}-trial{trial}", trial=trial, seed=sim["seed"] + trial,
                     messages=msgs)
            if trial:  # the replayed trials are not graded: reward 0 (τ² rewards 0 or 1)
                s["reward_info"] = {"reward": 0.0, "info": {"note": "built fixture trial"}}
                s["termination_reason"] = "agent_error" if trial == 3 else "user_stop"
            out_sims.append(s)
    out_sims.sort(key=lambda s: s["trial"])  # τ²'s order: trial by trial, each over the tasks
    info = dict(data["info"], num_trials=4)
    out = {"timestamp": data["timestamp"], "info": info,
           "tasks": [t for t in data["tasks"] if t["id"] in tasks], "simulations": out_sims}
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{OUT}: {len(out_sims)} simulations, {OUT.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
