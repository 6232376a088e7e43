//! Assembles the counter guest of `twig-bench fc` (guests/counter.S) with
//! binutils into an ELF image loaded at 1 MiB, which both twig-vmm and
//! Firecracker boot.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?} (install binutils): {e}"));
    assert!(status.success(), "{cmd:?} failed: {status}");
}

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let src = "guests/counter.S";
    println!("cargo:rerun-if-changed={src}");
    let obj = out.join("counter.o");
    run(Command::new("as").args(["--64", "-o"]).arg(&obj).arg(src));
    run(Command::new("ld")
        .args([
            "-N",
            "--no-warn-rwx-segments",
            "-nostdlib",
            "-static",
            "-Ttext=0x100000",
            "-e",
            "_start",
            "-o",
        ])
        .arg(out.join("counter.elf"))
        .arg(&obj));
}
