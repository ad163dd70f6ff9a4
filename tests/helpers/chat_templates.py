"""Chat templates shaped like the Qwen3 releases' (their generation prompts), for tests of thinking mode."""

# Shapes of the Qwen3 templates' generation prompts (the released templates are longer).
HYBRID = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
          "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
THINKING_2507 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
INSTRUCT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
