#!/usr/bin/env bash
# The native modules built for coverage-guided fuzzing (`make fuzz`), beside the normal ones:
#   tests/fuzz/build_sanitized.sh PYTHON OUT
# makes, under OUT (build/fuzz):
#   asan_with_fuzzer.so   libFuzzer and the ASan runtime (UBSan's handlers included) as one
#                         shared object, to LD_PRELOAD into the Python that runs a harness:
#                         the atheris wheel does not ship it, so it is made here the way
#                         atheris's sdist does (setup_utils/merge_libfuzzer_sanitizer.sh),
#                         from clang's own runtime archives;
#   lib/kvcache/_native/  every extension compiled by clang with ASan, UBSan and libFuzzer's
#                         coverage counters (-fsanitize=fuzzer-no-link); the in-place modules
#                         (kvcache/_native/*.so) are not touched.
# CFLAGS replaces Python's own compile flags, so -fwrapv is gone here: a signed overflow
# that the normal build defines as wrapping is reported by UBSan as the undefined behaviour
# the C standard says it is.
set -euo pipefail

python=${1:?usage: build_sanitized.sh PYTHON OUT}
out=${2:?usage: build_sanitized.sh PYTHON OUT}
arch=$(uname -m)

die() { echo "fuzz: ERROR: $*" >&2; exit 1; }

command -v clang >/dev/null || die "no clang on PATH (Debian: apt-get install clang)"
runtime() {  # the path of one of clang's runtime archives, or an error naming the package
    local path
    path=$(clang -print-file-name="$1")
    [ -f "$path" ] || die "clang has no $1 (Debian: apt-get install clang; on LLVM 15 and later also libclang-rt-<version>-dev)"
    echo "$path"
}
fuzzer=$(runtime "libclang_rt.fuzzer_no_main-$arch.a")
asan=$(runtime "libclang_rt.asan-$arch.a")

mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# ASan's preinit object registers its initializer in .preinit_array, which only an executable
# may have: it is taken out of a copy of the archive (either name, by clang version).
cp "$asan" "$tmp/asan.a"
ar d "$tmp/asan.a" asan_preinit.cc.o asan_preinit.cpp.o 2>/dev/null || true
clang++ -Wl,--whole-archive "$fuzzer" "$tmp/asan.a" -Wl,--no-whole-archive -lpthread -ldl -shared \
    -o "$tmp/asan_with_fuzzer.so"
mv "$tmp/asan_with_fuzzer.so" "$out/asan_with_fuzzer.so"
echo "fuzz: $out/asan_with_fuzzer.so (libFuzzer + ASan/UBSan runtime, from clang $(clang -dumpversion))"

sanitize="-fsanitize=address,undefined -fsanitize=fuzzer-no-link"
rm -rf "$out/lib"
CC=clang CXX=clang++ LDSHARED="clang -shared" \
    CFLAGS="$sanitize -fno-omit-frame-pointer -g -O1" \
    LDFLAGS="$sanitize" \
    "$python" setup.py -q build_ext --force --build-lib "$out/lib" --build-temp "$out/temp" -j 2

# every module must carry the instrumentation: coverage counters for libFuzzer, ASan's checks
count=0
for so in "$out"/lib/kvcache/_native/*.so; do
    symbols=$(nm -D --undefined-only "$so")
    for needed in __sanitizer_cov_8bit_counters_init __asan_report_load1 __ubsan_handle_; do
        grep -q "$needed" <<<"$symbols" || die "$so lacks $needed: not built with the sanitizers"
    done
    count=$((count + 1))
done
[ "$count" -gt 0 ] || die "no module built under $out/lib/kvcache/_native"
echo "fuzz: $count sanitized modules in $out/lib/kvcache/_native (coverage counters, ASan, UBSan)"
