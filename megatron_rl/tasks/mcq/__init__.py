"""The built-in `mcq` task: multiple choice in the `[ans]…[/ans]` answer format (the demo's task).

`answer.py` parses the tag and holds the rewards, `prompts.py` asks for it, `task.py` is the `TASK`;
`scoring.py` scores single-answer MCQ predictions of any prompt file (`megatron-rl eval mcq`).
"""
