"""The built-in `medmcqa` task (English medical MCQ, options a–d): the reader and preparation
(`data.py`), the strict/flexible answer rewards (`rewards.py`) and the `TASK` (`task.py`)."""
