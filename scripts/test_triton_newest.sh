#!/usr/bin/env bash
# Runs the tests whose outcome depends on the Triton release again under the newest one: the tile
# tables and path choices (test_families, test_autotune, test_pingpong), the register and
# architecture checks (test_registers, test_arch_matrix: offline compiles), and a correctness subset of
# each path against float64 in the interpreter (below). The main run (scripts/test.sh) uses the Triton
# installed (setup_env.sh's triton==3.6.0 where none is). A virtual environment (scripts/side_venv.sh)
# takes torch, kernels and pytest from the main environment and adds only triton==$TRITON_NEWEST
# (`TRITON_NEWEST=3.8.0` for another release); scripts/test.sh then runs the files there, choosing the
# interpreter as it does for the main run. Extra arguments pass to pytest. scripts/test.sh runs this
# after a full run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TRITON_NEWEST=${TRITON_NEWEST:-3.9.0}
VENV=${TRITON_NEWEST_VENV:-.venv-triton-$TRITON_NEWEST}

bash scripts/side_venv.sh "$VENV" "triton==$TRITON_NEWEST"

# The tables and path choices, the offline compiles, then a correctness subset of each path against
# float64 in the interpreter (or on the GPU): both gradient paths of the loss through descriptors and
# pointer loads, the chunked sweep's stored tile, the per-token fields and top-k, the divergence, the
# products and the compensated pairs (the long-context plan's int8 pair), the chunked buffer hosted in
# grad_weight, and the interpreter's bf16 emulation the CPU cases rely on.
K=tests/kernel
FILES=(
    "$K/test_families.py" "$K/test_autotune.py" "$K/test_pingpong.py"
    "$K/test_registers.py" "$K/test_arch_matrix.py"
    "$K/test_correctness.py::test_pointer_loads_match_float64_reference"
    "$K/test_correctness.py::test_tma_descriptors_where_the_layout_allows"
    "$K/test_correctness.py::test_chunked_sweep_stores_through_a_descriptor_where_the_layout_allows"
    "$K/test_logprobs.py::test_fields_and_gradients_match_float64"
    "$K/test_topk_logprobs.py::test_topk_only_kl_against_float64"
    "$K/test_divergence.py::test_matches_reference_16bit"
    "$K/test_products.py::test_matmul_through_tma_descriptors_is_the_sum_rounded_once"
    "$K/test_products.py::test_matmul_takes_pointer_loads_where_tma_does_not_apply"
    "$K/test_compensated.py::test_the_pair_follows_the_exact_sum_where_a_plain_16bit_sum_drifts"
    "$K/test_compensated_bits.py::test_a_4bit_remainder_holds_the_sum_to_12_bits"
    "$K/test_compensated_bits.py::test_the_long_context_plan_sums_grad_hidden_in_the_int8_pair"
    "$K/test_hosted_chunk.py::test_hosted_against_float64"
    "$K/test_bf16_emulation.py"
)
PYTHON="$VENV/bin/python" exec bash scripts/test.sh "${FILES[@]}" "$@"
