"""The engines' own chat-template flags at the router: `chat_template` (`--chat-template`),
`chat_template_content_format`, `default_chat_template_kwargs` and
`exclude_tools_when_tool_choice_none`. Engines started with them render chats their own way;
a router left on the tokenizer folder's template rendered another prompt, so every chat missed
the cache (its parity probe then put the workers in fallback). Real vLLM:
tests/vllm/test_chat_parity.py (an engine started with all four flags)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_router_api import tokenizer_dir
from test_router_config import _router_cli

from router.chat_template import TemplateLoadError, engine_template
from router.config import ConfigError, load_config
from router.responses import chat_view
from router.tokenize import RouterTokenizer, TokenizerError

__all__ = ["tokenizer_dir"]
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    "<{{ house | default('-') }}|{{ enable_thinking | default('-') }}|"
    "{{ reasoning_effort | default('-') }}|{{ documents | default('-') }}>"
)
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}],
                        "add_generation_prompt": False}  # fmt: skip


def _tok(folder: Path, engine: str | None = None, **settings: Any) -> RouterTokenizer:
    tok = RouterTokenizer(folder, chat_template=TEMPLATE, **settings)
    tok.engine = engine
    return tok


def test_the_setting_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    """As vLLM 0.32's `load_chat_template`: a readable file is read; text with a brace or a
    newline that names no file is the template; anything else is a missing file, named."""
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert engine_template(str(path)) == TEMPLATE
    assert engine_template(TEMPLATE) == TEMPLATE
    assert engine_template("plain\ntext") == "plain\ntext"
    for missing in (str(tmp_path / "nope.jinja"), "tool_chat_template_llama.jinja", str(tmp_path)):
        with pytest.raises(TemplateLoadError, match="names no readable file"):
            engine_template(missing)
    path.write_bytes(b"\xff{{ x }}")
    with pytest.raises(TemplateLoadError, match="cannot read the chat template"):
        engine_template(str(path))


def test_the_given_template_replaces_the_folders(tokenizer_dir: Path) -> None:
    default = RouterTokenizer(tokenizer_dir).render_chat(CHAT)
    given = _tok(tokenizer_dir).render_chat(CHAT)
    assert given == "[user:hi]<-|-|-|None>" and given != default
    with pytest.raises(TokenizerError, match="the chat template given does not parse"):
        RouterTokenizer(tokenizer_dir, chat_template="{% for %}")


def test_an_sglang_fleet_reads_a_template_file_as_sglang_reads_it(
    tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang 0.5 reads a `.jinja` file without its leading and trailing newlines and with each
    written-out backslash-n as a newline; vLLM 0.32 reads the file as it is. The fleet's engine
    is known at start-up: the router follows it. A file not named `.jinja` is a JSON
    conversation template to SGLang: the router keeps the Jinja reading and says so (its
    parity probe then routes the workers by load)."""
    path = tmp_path / "chat.jinja"
    path.write_text("\n\n{% for m in messages %}{{ m['content'] }}\\n{% endfor %}\n\n")
    tok = RouterTokenizer(tokenizer_dir, chat_template=str(path))
    assert tok.render_chat(CHAT) == "\n\nhi\\n"
    tok.engine = "sglang"
    assert tok.render_chat(CHAT) == "hi\n"
    tok.engine = "vllm"
    assert tok.render_chat(CHAT) == "\n\nhi\\n"
    inline = _tok(tokenizer_dir, "sglang")  # the router's own setting holds the text
    assert inline.render_chat(CHAT) == "[user:hi]<-|-|-|None>"
    other = tmp_path / "chat.txt"
    other.write_text(TEMPLATE)
    tok = RouterTokenizer(tokenizer_dir, chat_template=str(other))
    with caplog.at_level("ERROR", "warply.router"):
        tok.engine = "sglang"
    assert "as a JSON conversation template" in caplog.text
    assert tok.render_chat(CHAT) == inline.render_chat(CHAT)
    with pytest.raises(TokenizerError, match="vLLM's and SGLang's built-in template names"):
        RouterTokenizer(tokenizer_dir, chat_template="chatml")


def test_a_content_format_given_overrides_the_detected_one(tokenizer_dir: Path) -> None:
    """`--chat-template-content-format openai` hands a template that prints `content` the
    parts, which auto-detection (no loop over the content) would not."""
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert _tok(tokenizer_dir).render_chat(body).startswith("[user:a]")
    parts = _tok(tokenizer_dir, content_format="openai").render_chat(body)
    assert parts.startswith("[user:[{'type': 'text', 'text': 'a'}]]"), parts
    # SGLang has no such flag: it detects the format whatever the router is told
    sglang = _tok(tokenizer_dir, "sglang", content_format="openai").render_chat(body)
    assert sglang.startswith("[user:a]"), sglang


@pytest.mark.parametrize(
    ("request_fields", "vllm", "sglang"),
    [
        ({}, "<acme|False|-|None>", "<acme|False|-|None>"),
        ({"chat_template_kwargs": {"house": "beta"}}, "<beta|False|-|None>",
         "<beta|False|-|None>"),
        # vLLM counts None and "auto" as unset once it has defaults; SGLang keeps the value
        ({"chat_template_kwargs": {"house": None}}, "<acme|False|-|None>", "<None|False|-|None>"),
        ({"chat_template_kwargs": {"house": "auto"}}, "<acme|False|-|None>",
         "<auto|False|-|None>"),
        # an effort turns thinking on in both, over the default
        ({"reasoning_effort": "high"}, "<acme|True|high|None>", "<acme|True|high|None>"),
        ({"reasoning_effort": "none"}, "<acme|False|none|None>", "<acme|False|none|None>"),
        ({"chat_template_kwargs": {"documents": ["d"]}}, "<acme|False|-|['d']>",
         "<acme|False|-|['d']>"),
        # SGLang has no `documents` field
        ({"documents": ["e"]}, "<acme|False|-|['e']>", "<acme|False|-|None>"),
    ],
)  # fmt: skip
def test_default_kwargs_merge_as_each_engine_merges_them(
    tokenizer_dir: Path, request_fields: dict[str, Any], vllm: str, sglang: str
) -> None:
    defaults = {"house": "acme", "enable_thinking": False}
    body = {**CHAT, **request_fields}
    assert _tok(tokenizer_dir, default_kwargs=defaults).render_chat(body).endswith(vllm)
    assert _tok(tokenizer_dir, "sglang", default_kwargs=defaults).render_chat(body).endswith(
        sglang
    )


def test_an_effort_among_sglang_defaults_wins_as_the_clients_kwargs_would(
    tokenizer_dir: Path,
) -> None:
    """SGLang 0.5 copies its defaults into the request's `chat_template_kwargs`, which it lays
    over the request's `reasoning_effort`: a default effort is rendered even when a request
    names another (vLLM lets the request's win); the request's own effort still turned
    thinking on when its request model was built."""
    defaults = {"reasoning_effort": "low"}
    tok = _tok(tokenizer_dir, "sglang", default_kwargs=defaults)
    assert tok.render_chat(CHAT).endswith("<-|-|low|None>")
    assert tok.render_chat({**CHAT, "reasoning_effort": "high"}).endswith("<-|True|low|None>")
    vllm = _tok(tokenizer_dir, default_kwargs=defaults)
    assert vllm.render_chat({**CHAT, "reasoning_effort": "high"}).endswith("<-|True|high|None>")


def test_tools_are_left_out_for_tool_choice_none_as_the_engines_leave_them(
    tokenizer_dir: Path,
) -> None:
    """vLLM with `--exclude-tools-when-tool-choice-none` (a chat, or a response's chat) and
    SGLang always: a request whose `tool_choice` is "none" reaches the template without its
    tools; vLLM without the flag renders them."""
    template = "{% if tools %}<tools>{{ tools | length }}{% endif %}" + TEMPLATE
    tool = {"type": "function", "function": {"name": "f"}}
    chat = {**CHAT, "tools": [tool], "tool_choice": "none"}
    response = {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}
    for engine, exclude, printed in ((None, False, True), (None, True, False),
                                     ("sglang", False, False)):  # fmt: skip
        tok = RouterTokenizer(tokenizer_dir, chat_template=template,
                              exclude_tools_when_none=exclude)  # fmt: skip
        tok.engine = engine
        assert tok.render_chat(chat).startswith("<tools>1") is printed
        assert tok.render_chat({**chat, "tool_choice": "auto"}).startswith("<tools>1")
        if engine is None:
            view = chat_view(response)
            assert view is not None
            assert tok.render_chat(view).startswith("<tools>1") is printed


def test_the_settings_are_validated(tmp_path: Path, tokenizer_dir: Path) -> None:
    worker = {"name": "w", "url": "http://h:1"}
    base = {"model": "m", "tokenizer": str(tokenizer_dir),
            "pools": [{"name": "p", "block_size": 16, "workers": [worker]}]}  # fmt: skip
    config = load_config(None, {**base, "chat_template": TEMPLATE,
                                "default_chat_template_kwargs": {"house": "x"}})  # fmt: skip
    assert config.chat_template == TEMPLATE and config.chat_template_content_format == "auto"
    for bad, field in (
        ({"chat_template_content_format": "parts"}, "chat_template_content_format"),
        ({"default_chat_template_kwargs": {"tools": []}}, "each request sets these"),
        ({"default_chat_template_kwargs": ["x"]}, "default_chat_template_kwargs"),
        ({"chat_template": ""}, "chat_template"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config(None, {**base, **bad})


def test_the_flags_mirror_the_engines(tmp_path: Path, tokenizer_dir: Path) -> None:
    """`--chat-template`, `--chat-template-content-format`, `--default-chat-template-kwargs`,
    `--exclude-tools-when-tool-choice-none`, `--anthropic-disabled-thinking-effort` as vLLM
    spells them and `--hf-chat-template-name` as SGLang does; a bad one is one line and exit 2."""
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    common = ["--model", "m", "--tokenizer", str(tokenizer_dir), "--worker", "http://h:1",
              "--block-size", "16", "--check"]  # fmt: skip
    ok = _router_cli(*common, "--chat-template", str(path), "--chat-template-content-format",
                     "openai", "--default-chat-template-kwargs", '{"house": "x"}',
                     "--exclude-tools-when-tool-choice-none",
                     "--anthropic-disabled-thinking-effort", "low",
                     "--hf-chat-template-name", "tool_use")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert f"chat template {path} (not the tokenizer folder's)" in ok.stdout
    assert (
        'chat: content format openai, template defaults {"house": "x"}, tools left out for '
        "tool_choice none, thinking disabled as effort low, SGLang's named template tool_use"
        in ok.stdout
    ), ok.stdout
    plain = _router_cli(*common)
    assert plain.returncode == 0 and "chat" not in plain.stdout, plain.stdout
    for flags, message in (
        (["--chat-template", str(tmp_path / "gone.jinja")], "names no readable file"),
        (["--default-chat-template-kwargs", "{house"], "--default-chat-template-kwargs is not"),
        (["--chat-template-content-format", "parts"], "chat_template_content_format"),
        (["--anthropic-disabled-thinking-effort", "off"], "anthropic_disabled_thinking_effort"),
    ):
        out = _router_cli(*common, *flags)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


NAMED = {"default": "default:{{ messages[0]['content'] }}",
         "tool_use": "tool_use:{{ tools | length }}:{{ messages[0]['content'] }}",
         "rag": "rag:{{ messages[0]['content'] }}"}  # fmt: skip


def _named_folder(tmp_path: Path, tokenizer_dir: Path, layout: str) -> Path:
    """A model folder holding NAMED as tokenizer_config.json's list ("config") or as
    chat_template.jinja and additional_chat_templates/*.jinja ("files", transformers 5)."""
    folder = tmp_path / layout
    folder.mkdir()
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    if layout == "config":
        config["chat_template"] = [{"name": n, "template": t} for n, t in NAMED.items()]
    else:
        config.pop("chat_template", None)
        (folder / "chat_template.jinja").write_text(NAMED["default"])
        (folder / "additional_chat_templates").mkdir()
        for name in ("tool_use", "rag"):
            (folder / "additional_chat_templates" / f"{name}.jinja").write_text(NAMED[name])
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("layout", ["config", "files"])
def test_a_folders_named_templates_are_picked_as_transformers_picks_them(
    tmp_path: Path, tokenizer_dir: Path, layout: str
) -> None:
    """On vLLM a tool chat renders with the "tool_use" template, a request's `chat_template`
    may name one, anything else renders with "default" (the router rendered "default" always,
    so every tool chat on such a model was predicted from another prompt); SGLang 0.5 renders
    every chat with the one its `--hf-chat-template-name` names, else the first. Against
    transformers itself: tests/vllm/test_chat_parity.py; against SGLang's choice:
    tests/sglang/test_chat_shape.py."""
    tok = RouterTokenizer(_named_folder(tmp_path, tokenizer_dir, layout))
    tool = {"type": "function", "function": {"name": "f"}}
    plain = {**CHAT, "add_generation_prompt": False}
    assert tok.render_chat(plain) == "default:hi"
    assert tok.render_chat({**plain, "tools": [tool]}) == "tool_use:1:hi"
    assert tok.render_chat({**plain, "tools": []}) == "tool_use:0:hi"  # a list, even empty
    assert tok.render_chat({**plain, "chat_template": "rag"}) == "rag:hi"
    assert tok.render_chat({**plain, "chat_template": "{{ 'own' }}"}) == "own"
    excluding = RouterTokenizer(tok.folder, exclude_tools_when_none=True)
    assert excluding.render_chat({**plain, "tools": [tool], "tool_choice": "none"}) == "default:hi"
    tok.engine = "sglang"  # SGLang keeps one template: the first, whatever the request
    assert tok.render_chat({**plain, "tools": [tool]}) == "default:hi"
    assert tok.render_chat({**plain, "chat_template": "rag"}) == "default:hi"
    named = RouterTokenizer(tok.folder, hf_template_name="tool_use")  # --hf-chat-template-name
    named.engine = "sglang"
    assert named.render_chat({**plain, "tools": [tool, tool]}) == "tool_use:2:hi"
    assert named.render_chat({**plain, "tools": [tool], "chat_template": "rag"}) == "tool_use:1:hi"
    # A `chat_template` among the template arguments is transformers' own argument: the text
    # SGLang renders with (a request's, else the server's --default-chat-template-kwargs').
    own = {**plain, "chat_template_kwargs": {"chat_template": "{{ chat_template }}kw"}}
    assert named.render_chat(own) == "kw"
    served = RouterTokenizer(tok.folder, default_kwargs={"chat_template": "{{ 'server' }}"})
    served.engine = "sglang"
    assert served.render_chat(plain) == "server" and served.render_chat(own) == "kw"
    with pytest.raises(TokenizerError, match="hf_chat_template_name 'chat' names none"):
        RouterTokenizer(tok.folder, hf_template_name="chat")  # SGLang refuses it as well
    assert RouterTokenizer(tokenizer_dir, hf_template_name="chat")  # one template: not by name


def test_a_single_template_is_not_looked_up_by_name(tmp_path: Path, tokenizer_dir: Path) -> None:
    """transformers keeps one template as a text, not by name: a request naming "default"
    renders that word as its template; a given `--chat-template` replaces the folder's named
    ones, "tool_use" included."""
    tok = RouterTokenizer(tokenizer_dir)
    assert tok.render_chat({**CHAT, "chat_template": "default"}) == "default"
    folder = _named_folder(tmp_path, tokenizer_dir, "files")
    given = RouterTokenizer(folder, chat_template=TEMPLATE)
    tool = {"type": "function", "function": {"name": "f"}}
    assert given.render_chat({**CHAT, "tools": [tool]}).startswith("[user:hi]")
    (folder / "additional_chat_templates" / "rag.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerError, match="the chat template 'rag' in .* does not parse"):
        RouterTokenizer(folder)
