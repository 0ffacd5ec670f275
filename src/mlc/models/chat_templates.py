"""Built-in chat templates for GLM checkpoints that ship none, with tool calling.

GLM-4 (glm, glm4, chatglm): LLaMA-Factory's glm4 layout; tools go in a system block ("# 可用工具", each function as
indented JSON); the model calls one with a line holding the function name, then its JSON arguments, right after
`<|assistant|>`; tool results come back as `<|observation|>` turns. The model writes the newline after
`<|assistant|>` itself, so a plain reply starts with "\\n".

GLM-4.5/4.6/4.7/5 (glm4_moe, glm_moe_dsa): a "# Tools" system block with one JSON signature per line inside
<tools></tools>; calls as `<tool_call>NAME` followed by `<arg_key>K</arg_key>` / `<arg_value>V</arg_value>` pairs
(strings bare, other values as JSON); results as `<tool_response>` blocks after one `<|observation|>`; reasoning in
`<think>...</think>` after `<|assistant|>`, and `enable_thinking: false` closes it empty in the prompt.
"""

from __future__ import annotations

GLM4_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools %}<|system|>\n# 可用工具"
    "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}{{ '\n\n## ' + f.name }}"
    "\n\n{{ f | tojson(indent=4) }}\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
    "{%- endfor %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'user' %}<|user|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] or not message.tool_calls %}<|assistant|>\n{{ message['content'] or '' }}{%- endif %}"
    "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "<|assistant|>{{ f.name }}\n{{ f.arguments if f.arguments is string else (f.arguments | tojson) }}"
    "{%- endfor %}"
    "{%- elif message['role'] in ('tool', 'observation') %}<|observation|>\n{{ message['content'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

GLM45_TOOLS_PREAMBLE = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{%- endfor %}{{ '\n</tools>\n\n' }}"
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)

GLM45_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools %}" + GLM45_TOOLS_PREAMBLE + "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- set no_think = enable_thinking is defined and not enable_thinking %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'user' %}<|user|>\n{{ m.content }}{{ '/nothink' if no_think else '' }}"
    "{%- elif m.role == 'assistant' %}<|assistant|>"
    "{%- set r = m.reasoning_content if m.reasoning_content is string and loop.index0 > ns.last_user else '' %}"
    "{{ '\n<think>' + r.strip() + '</think>' }}"
    "{%- if m.content and m.content.strip() %}{{ '\n' + m.content.strip() }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{ '\n<tool_call>' + f.name }}"
    "{%- for k, v in (f.arguments or {}).items() %}"
    "{{ '\n<arg_key>' + k + '</arg_key>\n<arg_value>' }}{{ v if v is string else (v | tojson) }}</arg_value>"
    "{%- endfor %}{{ '\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{%- endif %}"
    "{{ '\n<tool_response>\n' }}{{ m.content }}{{ '\n</tool_response>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{{ '\n<think></think>' if no_think else '' }}{%- endif %}"
)

GLM4_MODEL_TYPES = ("glm", "glm4", "chatglm")
GLM45_MODEL_TYPES = ("glm4_moe", "glm_moe_dsa")
# transformers renders templates with trim_blocks: a newline right after a block tag is dropped, so the templates
# above write such newlines inside {{ }}.


def builtin_template(model_type: str | None) -> str | None:
    """The template a GLM checkpoint without one gets (None for other architectures)."""
    if model_type in GLM45_MODEL_TYPES:
        return GLM45_CHAT_TEMPLATE
    if model_type in GLM4_MODEL_TYPES:
        return GLM4_CHAT_TEMPLATE
    return None
