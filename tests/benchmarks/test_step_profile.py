"""benchmarks.step_profile's attribution of py-spy stacks to categories (no profiling here)."""

from benchmarks.step_profile import attribute, category

ROOT = ["<module> (bench.py:1)", "LLMEngine.step (engine/llm_engine.py:199)"]
FORWARD = ROOT + ["DecoderModel.forward (engine/models/decoder.py:283)"]
CALL = ["PyCFuncPtr_call (_ctypes.c:4201)", "ffi_call (libffi.so.8)"]


def test_a_native_kernel_is_charged_by_its_entry_point_even_inside_openmp():
    gemm = FORWARD + ["linear_q8_native (kernels/cpu/linear_quant.py:129)", *CALL,
                      "pg_linear_q8 (prefixgate_cpu.so)", "GOMP_parallel (libgomp.so.1)",
                      "gomp_barrier_wait_end (libgomp.so.1)"]
    assert category(gemm) == "gemm"
    attention = FORWARD + ["paged_prefill_native (kernels/cpu/prefill.py:80)", *CALL,
                           "pg_paged_prefill_f32._omp_fn.0 (prefixgate_cpu.so)"]
    assert category(attention) == "attention"
    norm = FORWARD + ["rms_norm_native (kernels/cpu/ops.py:40)", *CALL,
                      "pg_rms_norm_f32 (prefixgate_cpu.so)"]
    assert category(norm) == "native_ops"


def test_wrappers_and_ctypes_are_dispatch_the_model_code_is_python():
    assert category(FORWARD + ["rms_norm_native (kernels/cpu/ops.py:40)"]) == "dispatch"
    assert category(FORWARD + ["rms_norm_native (kernels/cpu/ops.py:40)", *CALL]) == "dispatch"
    assert category(FORWARD + ["torch::PythonArgParser::raw_parse (libtorch_python.so)"]) == "dispatch"
    assert category(FORWARD) == "python"
    assert category(FORWARD + ["at::native::add_out (libtorch_cpu.so)"]) == "torch_ops"


def test_sampling_and_grammar_win_over_what_runs_below_them():
    sampler = ROOT + ["Sampler.sample (engine/sampler.py:50)",
                      "at::native::argmax (libtorch_cpu.so)"]
    assert category(sampler) == "sampling"
    masks = ROOT + ["StepMasks.apply (engine/step_masks.py:10)",
                    "pg_apply_token_bitmask_f32 (prefixgate_cpu.so)"]
    assert category(masks) == "grammar"


def test_attribute_counts_only_stacks_inside_a_step():
    raw = "\n".join([
        "thread (1): MainThread;" + ";".join(FORWARD) + " 7",
        "thread (1): MainThread;<module> (bench.py:1);sleep (time.py:1) 50",
        "thread (2): prefixgate-grammar;worker (engine/grammar/masker.py:35) 9",
    ])
    assert attribute(raw) == {"python": 7}
