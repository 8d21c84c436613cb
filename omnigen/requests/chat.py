"""Chat requests: OpenAI chat messages to the first stage's prompt, through the checkpoint's own
chat template (the common part of every omni model's request builder).

The prompt is what vLLM's chat path makes of the same messages (``vllm/entrypoints/chat_utils.py``
``parse_chat_messages`` and ``vllm/renderers/hf.py`` ``safe_apply_chat_template``, as vllm-omni's
``OmniOpenAIServingChat._preprocess_chat`` calls them), written here for text content:

* the template: the checkpoint tokenizer's (``chat_template`` in ``tokenizer_config.json`` or
  ``chat_template.jinja``); a checkpoint without one is refused when the server starts;
* the content format, read from the template as vLLM reads it: ``openai`` when the template loops
  over a message's content (each text part then reaches it as ``{"type": "text", "text": ...}``),
  else ``string`` (a message's non-empty text parts joined with newlines);
* the template rendered with ``add_generation_prompt=True`` to text, then tokenized without special
  tokens (vLLM's default for chat requests).

Content parts other than text (images, audio, video) need the first stage's multimodal processor;
a builder takes them only where that processor runs, else the request is refused naming the part
and why. Roles are ``system``, ``user`` and ``assistant``; a message has ``role`` and ``content``
(a string, a list of parts, or null for none), nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from omnigen.requests.base import BuiltRequest, ChatInput, RequestBuilder, RequestError

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content")
TEXT_PART = "text"
MEDIA_PARTS = ("image_url", "input_image", "audio_url", "input_audio", "video_url", "image", "audio", "video")
"""Content parts that carry media for the multimodal processor (OpenAI's and vLLM's names)."""


def _read_config(folder: Path, title: str) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{title} checkpoint: {path} is missing") from None
    if not isinstance(data, dict):
        raise ValueError(f"{title} checkpoint: {path} is not a JSON object")
    return data


# -- the template's content format (as vLLM detects it) ------------------------------------------


def content_format(template: str) -> str:
    """``openai`` when ``template`` iterates over a message's content, else ``string``.

    Found the way vLLM finds it (``renderers/hf.py`` ``_detect_content_format``): in the template's
    syntax tree, a ``for`` loop over ``m['content']`` / ``m.content`` (possibly filtered or
    sliced) where ``m`` is the target of a loop over ``messages`` (or over a variable assigned
    from it), over a macro parameter that such a content is passed to, or, outside macros, over a
    variable named ``content``. A template that does not parse is ``string``.
    """
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag) parses."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, Generation])
    try:
        tree = env.parse(template)
    except jinja2.TemplateError:
        return "string"

    def base(node: nodes.Node) -> nodes.Node:
        while True:
            if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
                node = node.node
            elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
                node = node.node
            else:
                return node

    def is_name(node: nodes.Node, names: set[str]) -> bool:
        node = base(node)
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names

    def is_content_of(node: nodes.Node, names: set[str]) -> bool:
        node = base(node)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            return node.arg.value == "content" and is_name(node.node, names)
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and is_name(node.node, names)
        return False

    # Names bound to the messages list (and to what is assigned from it, transitively).
    message_lists = {"messages"}
    changed = True
    while changed:
        changed = False
        for assign in tree.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and assign.target.name not in message_lists:
                if is_name(assign.node, message_lists):
                    message_lists.add(assign.target.name)
                    changed = True
    messages = {
        loop.target.name
        for loop in tree.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and is_name(loop.iter, message_lists)
    }
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in tree.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                bound |= {
                    params[i]
                    for i, arg in enumerate(call.args[: len(params)])
                    if is_content_of(arg, messages)
                }
                bound |= {
                    kw.key for kw in call.kwargs if kw.key in params and is_content_of(kw.value, messages)
                }
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            macro_params[id(loop)] = bound
    for loop in tree.find_all(nodes.For):
        if is_content_of(loop.iter, messages):
            return "openai"
        if isinstance(loop.iter, nodes.Name):
            if loop.iter.name in macro_params.get(id(loop), set()):
                return "openai"
            if id(loop) not in in_macros and loop.iter.name == "content":
                return "openai"
    return "string"


# -- the builder ---------------------------------------------------------------------------------


class ChatRequestBuilder(RequestBuilder):
    """Chat requests rendered with the checkpoint's chat template; subclasses add the model's
    voices, its first stage's payload and the sampling the checkpoint decides."""

    api: ClassVar[str] = "chat"
    title: ClassVar[str] = "the model"
    media_refusal: ClassVar[str] = "this server's first stage takes text only"
    """Why media content parts are refused (a subclass says which processor and modules)."""

    def __init__(self, checkpoint: str | Path, *, default_max_tokens: int | None = None) -> None:
        super().__init__(checkpoint, default_max_tokens=default_max_tokens)
        self.config = _read_config(self.checkpoint, self.title)
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one serves chats
            template = template.get("default")
        if not isinstance(template, str) or not template.strip():
            raise ValueError(
                f"{self.title} checkpoint {self.checkpoint}: its tokenizer has no chat template "
                "(tokenizer_config.json chat_template or chat_template.jinja), which renders the "
                "messages into the first stage's prompt"
            )
        self.chat_template: str = template
        self.content_format: str = content_format(template)

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.checkpoint), local_files_only=True)

    # -- messages -> prompt ------------------------------------------------------------------

    def conversation(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the chat template receives them (``RequestError`` names a bad one)."""
        if not messages:
            raise RequestError("messages", "no message: send at least one")
        found = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, Mapping):
                raise RequestError(where, "a message is an object with role and content")
            for key in message:
                if key not in MESSAGE_KEYS:
                    raise RequestError(
                        f"{where}.{key}", "not a message field this server reads", list(MESSAGE_KEYS)
                    )
            role = message.get("role")
            if role not in ROLES:
                raise RequestError(f"{where}.role", f"{role!r} is not a role this server takes", list(ROLES))
            texts = list(self._texts(message.get("content"), where))
            if self.content_format == "openai":
                content: Any = [{"type": TEXT_PART, "text": text} for text in texts]
            else:
                # vLLM's parser drops an empty text part here (it keeps it as a part above).
                content = "\n".join(text for text in texts if text)
            found.append({"role": role, "content": content})
        return found

    def _texts(self, content: Any, where: str) -> Iterator[str]:
        if content is None:
            return
        if isinstance(content, str):
            yield content
            return
        if not isinstance(content, list):
            raise RequestError(f"{where}.content", "a string, a list of content parts, or null")
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == TEXT_PART:
                extra = sorted(set(part) - {"type", "text"})
                if extra:
                    raise RequestError(f"{at}.{extra[0]}", "not a text part's field", ["type", "text"])
                text = part.get("text")
                if not isinstance(text, str):
                    raise RequestError(f"{at}.text", "a text part's text must be a string")
                yield text
            elif kind in MEDIA_PARTS:
                raise RequestError(
                    f"{at}.type", f"{kind!r} content is not served: {self.media_refusal}", [TEXT_PART]
                )
            else:
                raise RequestError(
                    f"{at}.type", f"{kind!r} is not a content part type", [TEXT_PART, *MEDIA_PARTS]
                )

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The first stage's prompt text: the chat template applied with a generation prompt."""
        conversation = self.conversation(messages)
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
                continue_final_message=False,
            )
        except Exception as exc:  # the template's own refusal (jinja's raise_exception, ...)
            raise RequestError("messages", f"the chat template refused them: {exc}") from None

    def prompt_token_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        text = self.render(messages)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- one request ---------------------------------------------------------------------------

    def build_chat(self, request: ChatInput) -> BuiltRequest:
        """The first stage's prompt and payload for one chat request; subclasses add their payload."""
        if request.max_tokens is not None and request.max_tokens < 1:
            raise RequestError("max_tokens", f"{request.max_tokens} is not a positive token budget")
        ids = self.prompt_token_ids(request.messages)
        budget = request.max_tokens if request.max_tokens is not None else self.default_max_tokens
        return BuiltRequest(prompt={"prompt_token_ids": ids}, max_tokens=budget)
