"""parabench: benchmark and explain distributed training of one GPT definition."""
