"""Which chat template renders a request, as the engines pick it.

The engines' own `--chat-template` (`engine_template`: a file or the Jinja text, as vLLM 0.32
reads the flag; `sglang_template`: a `.jinja` file as SGLang 0.5 reads it) replaces the model
folder's. Otherwise the folder's templates, by name, as
transformers 5 loads them (`folder_templates`: chat_template.jinja as "default" and
additional_chat_templates/NAME.jinja when either exists, else tokenizer_config.json's
`chat_template`, one text or a list of named ones). Per request, `ChatTemplates.pick` chooses
as transformers' `get_chat_template` does, which both engines call: the request's own
`chat_template` (the name of one of the folder's named templates, or a template's text), else
"tool_use" when the request hands the template tools and the folder has that template
(Command R's and other tool-calling models' folders do), else "default". SGLang 0.5 instead
renders every request with one of them (`ChatTemplates.only`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from router.chat_shape import PromptError

_TEMPLATE_DIR = "additional_chat_templates"
"""transformers 5's folder of named templates beside chat_template.jinja (`CHAT_TEMPLATE_DIR`)."""


def bare_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The sandbox both engines render chat templates in (transformers' options: trimmed blocks,
    loop controls), with no globals or filters added: as vLLM's and SGLang's inline-system probes
    render a template; the router's renderer adds the engines' globals to it."""
    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )


class TemplateLoadError(ValueError):
    """A chat template cannot be read or does not parse; the message names it."""


def names_file(value: str) -> bool:
    """Whether a `chat_template` setting names a readable path (else it is the text itself)."""
    try:
        return Path(value).is_file()
    except (OSError, ValueError):  # a long or NUL-holding text is no file's name
        return False


def engine_template(value: str) -> str:
    """The Jinja text of a `chat_template` setting, read as vLLM 0.32 reads `--chat-template`:
    the file it names, else the text itself when it holds a brace or a newline."""
    if names_file(value):
        return _read(Path(value))
    if any(c in value for c in "{}\n"):
        return value
    raise TemplateLoadError(
        f"chat template {value!r} names no readable file (give the file's path: vLLM's and "
        "SGLang's built-in template names are not known to the router)"
    )


def sglang_template(value: str, text: str) -> str:
    """The Jinja text of a `chat_template` setting as SGLang 0.5 reads `--chat-template`
    (`TemplateManager._load_jinja_template`), from `text`, the setting as `engine_template`
    read it: a `.jinja` file's text without its leading and trailing newlines, each
    backslash-n written in it (two characters) read as a newline; a setting that names no file
    as it is (the router's own setting may hold the template). `TemplateLoadError` for another
    file: SGLang reads it as a JSON conversation template, which the router does not render."""
    if not names_file(value):
        return text
    if not value.endswith(".jinja"):
        raise TemplateLoadError(
            f"SGLang reads the chat template file {value!r} as a JSON conversation template "
            "(its name does not end in .jinja), which the router does not render"
        )
    return text.strip("\n").replace("\\n", "\n")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise TemplateLoadError(f"cannot read the chat template {path}: {exc}") from None


def folder_templates(folder: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], bool]:
    """The model folder's chat templates by name (`config`: its tokenizer_config.json), and
    whether transformers holds them by name: a single template (one file, or one text) is not
    looked up by name, a list or several files are."""
    files: dict[str, Path] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = folder / "chat_template.jinja"
    if (folder / _TEMPLATE_DIR).is_dir():
        extra = sorted((folder / _TEMPLATE_DIR).glob("*.jinja"))
        files.update({path.name.removesuffix(".jinja"): path for path in extra})
    if files:
        return {name: _read(path) for name, path in files.items()}, list(files) != ["default"]
    template = config.get("chat_template")
    if isinstance(template, list):
        pairs = ((t.get("name"), t.get("template")) for t in template if isinstance(t, Mapping))
        return {n: t for n, t in pairs if isinstance(n, str) and isinstance(t, str)}, True
    return ({"default": template} if isinstance(template, str) else {}), False


@dataclass(frozen=True, slots=True)
class Picked:
    """A chosen template: its text (content-format and role detection read it) and compiled."""

    source: str
    template: jinja2.Template


class ChatTemplates:
    """A fleet's chat templates, compiled once, and the choice of one per request."""

    def __init__(
        self, env: jinja2.Environment, sources: Mapping[str, str], by_name: bool, origin: str
    ) -> None:
        """`sources` by name, held `by_name` or as one template; `origin` says where they came
        from in errors ("given", "in FOLDER")."""
        self._env = env
        self._by_name = by_name
        self._named: dict[str, Picked] = {}
        for name, text in sources.items():
            label = f"{name!r} {origin}" if by_name else origin
            try:
                self._named[name] = Picked(text, env.from_string(text))
            except jinja2.TemplateError as exc:
                msg = f"the chat template {label} does not parse: {exc}"
                raise TemplateLoadError(msg) from None

    def only(self, name: str | None, given: Any = None) -> Picked:
        """The template SGLang 0.5 renders a request with: it keeps one, resolving a folder's
        named templates (`_select_named_template`) to `name` (its `--hf-chat-template-name`),
        else to the first ("default" where the folder has one; the router takes the other
        files in name order, transformers in directory order). A request's own
        `chat_template` and its tools choose nothing there; a `chat_template` among the
        template arguments (`given`: the request's `chat_template_kwargs` or the server's
        defaults) is the template's text, as transformers takes that argument."""
        if isinstance(given, str):
            return self._compiled(given)
        if not self._by_name:
            return self.pick(None, False)
        if name is None:
            return next(iter(self._named.values()))
        return self._named[name]

    def check_name(self, name: str | None) -> None:
        """`TemplateLoadError` when `name` (SGLang's `--hf-chat-template-name`) names none of
        the folder's named templates, which SGLang refuses at start-up too."""
        if name is not None and self._by_name and name not in self._named:
            raise TemplateLoadError(
                f"hf_chat_template_name {name!r} names none of the chat templates "
                f"({', '.join(self._named)})"
            )

    def _compiled(self, text: str) -> Picked:
        try:
            return Picked(text, self._env.from_string(text))
        except jinja2.TemplateError as exc:
            raise PromptError(f"chat template error: {exc}") from None

    def pick(self, requested: Any, tools: bool) -> Picked:
        """The template for a request whose own `chat_template` is `requested` and which hands
        the template tools when `tools`; `PromptError` when there is none or it does not
        parse."""
        if isinstance(requested, str):
            if self._by_name and requested in self._named:
                return self._named[requested]
            return self._compiled(requested)
        picked = self._named.get("tool_use") if tools and self._by_name else None
        picked = picked or self._named.get("default")
        if picked is None:
            raise PromptError("the model has no chat template")
        return picked
