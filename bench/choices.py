"""The values of RunConfig's choice fields, in one pure module that bench/config.py (the `Literal`
types) and bench/capabilities.py (what each backend runs of them) both import. The rank orders and
the pipeline schedules live with their maths (bench.layout.ORDERS, bench.schedule.SCHEDULES)."""

BACKENDS = ("native", "deepspeed", "fsdp", "ddp")
FSDP_MODES = ("full", "grad-op", "hybrid", "none")
DTYPES = ("fp32", "bf16-mixed", "fp16-mixed")
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
DEVICES = ("auto", "cpu", "cuda")
CP_COMMS = ("ring", "ulysses")
