"""Which tool-call format a model writes (router process): the parsers by name, and the one the
router uses, picked once at start-up.

``--tool-call-parser NAME`` wins. Without it the chat template tells (``detect``, first match):

| in the template | parser | models |
|---|---|---|
| ``<tool_call>`` and ``<function=`` | ``qwen3_coder`` | Qwen3-Coder |
| ``<tool_call>`` | ``hermes`` | Qwen 2.5 / 3, QwQ, Hermes 2 Pro / 3 |
| ``[TOOL_CALLS]`` | ``mistral`` | Mistral, Mixtral, Ministral, Devstral, Magistral |
| ``[func_name1(`` | ``pythonic`` | Llama 3.2 / 4 pythonic templates, ToolACE |
| ``<|python_tag|>`` or Llama 3's ``"parameters": dictionary of argument name`` | ``llama3_json`` | Llama 3.1-3.3 |
| no ``tools`` variable at all | ``hermes`` | SmolLM2 and other templates without tools |

A template that renders no tools gets them described by the router (router/tool_choice.py) in
the parser's format, hermes unless the flag says otherwise, so that format is known. A template
that renders tools in none of these ways leaves no parser: ``tool_choice`` "auto" is then a 400
that names the flag, while "none", "required" and named functions (forced by a JSON schema, no
parser needed) still work. "auto" is on by default whenever a parser is known
(``--no-enable-auto-tool-choice`` turns it off).

A format whose control tokens are special tokens (Mistral's ``[TOOL_CALLS]``, ``[ARGS]``,
``[CALL_ID]``) has them kept in the text of requests it reads (``marker_token_ids``): decoding
skips special tokens otherwise, and the parser would never see the marker.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.tokenizer import Tokenizer
from router.config import TOOL_CALL_PARSERS
from router.tool_calls import HermesParser, Llama3JsonParser, ToolCallParser
from router.tool_calls_mistral import MistralParser
from router.tool_calls_pythonic import PythonicParser
from router.tool_calls_xml import Qwen3CoderParser

PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                            "mistral": MistralParser, "pythonic": PythonicParser,
                                            "qwen3_coder": Qwen3CoderParser}

# (parser, strings that must all be in the template), checked in order
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qwen3_coder", ("<tool_call>", "<function=")),
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("pythonic", ("[func_name1(",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ('"parameters": dictionary of argument name',)),
)


def detect(chat_template: str | None, template_takes_tools: bool) -> tuple[str, str]:
    """(parser name, why) for a chat template; ("", why) when none is known."""
    if not chat_template or not template_takes_tools:
        return "hermes", "the chat template renders no tools, so the router describes them in hermes' format"
    for name, markers in _TEMPLATE_MARKERS:
        if all(m in chat_template for m in markers):
            return name, f"the chat template holds {' and '.join(map(repr, markers))}"
    return "", "the chat template renders tools in no format the router knows"


@dataclass(frozen=True)
class ToolFormat:
    parser_name: str                    # "" = none known
    reason: str                         # where parser_name came from, for the log and the 400
    auto_enabled: bool                  # tool_choice "auto" is allowed (with a parser)
    marker_token_ids: frozenset[int]    # special tokens the parser reads: kept in the text

    @classmethod
    def resolve(cls, tool_call_parser: str, enable_auto_tool_choice: bool, tokenizer: Tokenizer) -> ToolFormat:
        if tool_call_parser:
            name, reason = tool_call_parser, "--tool-call-parser"
        else:
            name, reason = detect(tokenizer.chat_template, tokenizer.template_takes_tools)
        markers = getattr(PARSERS[name], "MARKER_TOKENS", ()) if name else ()
        ids = (tokenizer.token_to_id(m) for m in markers)
        special = tokenizer.special_token_ids
        return cls(name, reason, enable_auto_tool_choice, frozenset(i for i in ids if i is not None and i in special))

    def auto_error(self) -> str | None:
        """Why tool_choice "auto" cannot be served; None when it can."""
        if not self.auto_enabled:
            return ('tool_choice "auto" is off on this router (--no-enable-auto-tool-choice); use "none", '
                    '"required" or a named function')
        if not self.parser_name:
            return (f'tool_choice "auto" needs a tool-call parser, and {self.reason}: start the router with '
                    f"--tool-call-parser {{{','.join(TOOL_CALL_PARSERS)}}}, or use \"none\", \"required\" or a "
                    "named function")
        return None

    def describe(self) -> str:
        if not self.parser_name:
            return f"tool calls: no parser ({self.reason}); tool_choice \"auto\" is refused"
        auto = "on" if self.auto_enabled else "off (--no-enable-auto-tool-choice)"
        return f"tool calls: parser {self.parser_name} ({self.reason}); tool_choice \"auto\" {auto}"
