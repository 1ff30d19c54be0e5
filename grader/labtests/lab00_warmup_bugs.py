"""Planted bugs for lab 00_warmup: each must make at least one official test fail."""
from grader.bugs import PlantedBug

BUGS = [
    PlantedBug("floor_division", "(num_tokens + block_size - 1) // block_size", "num_tokens // block_size"),
    PlantedBug("always_one_extra", "(num_tokens + block_size - 1) // block_size", "num_tokens // block_size + 1"),
    PlantedBug(
        "float_ceil",
        "return (num_tokens + block_size - 1) // block_size",
        "import math\n    return math.ceil(num_tokens / block_size)",
    ),
    PlantedBug("off_by_one_rounding", "block_size - 1", "block_size"),
]
