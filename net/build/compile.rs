//! Compiles one eBPF C source with clang. Shared by `build.rs` and a unit test
//! of the crate (which checks the error a missing clang gives).

use std::path::Path;
use std::process::Command;

/// Compiles `source` to the BPF object `output` with `clang -O2 -g -target bpf`.
///
/// Returns a message naming what to install when `clang` cannot be run, and
/// clang's own diagnostics when the compilation fails.
pub fn compile_bpf(clang: &Path, source: &Path, output: &Path) -> Result<(), String> {
    let mut command = Command::new(clang);
    command.args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]);
    // <asm/types.h> lives under the multiarch include directory on Debian.
    for multiarch in [
        "/usr/include/x86_64-linux-gnu",
        "/usr/include/aarch64-linux-gnu",
    ] {
        if Path::new(multiarch).is_dir() {
            command.arg(format!("-I{multiarch}"));
        }
    }
    command.arg("-c").arg(source).arg("-o").arg(output);
    let result = command.output().map_err(|e| {
        format!(
            "twig-net: cannot run `{}` to compile the eBPF programs ({e}); install clang, llvm \
             and libbpf-dev (scripts/install-deps.sh) or set TWIG_NET_CLANG to a clang binary",
            clang.display()
        )
    })?;
    if !result.status.success() {
        return Err(format!(
            "twig-net: `{}` failed to compile {} ({}):\n{}",
            clang.display(),
            source.display(),
            result.status,
            String::from_utf8_lossy(&result.stderr)
        ));
    }
    Ok(())
}
