"""Stand-in for mamba-ssm's Mamba2 kernels (tests/state_kernel_standins/README.md)."""

from collections import Counter

litft_device_type = "cpu"
calls = Counter()  # calls told where samples start, by function, for the tests to read
