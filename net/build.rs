//! Compiles `bpf/pod.c` and `bpf/forward.c` into `$OUT_DIR/pod.o` and
//! `$OUT_DIR/forward.o`, which the crate embeds —
//! only with the `loader` feature (without it nothing embeds the object, and
//! no clang is needed).

#[path = "build/compile.rs"]
mod compile;

use std::path::PathBuf;

fn main() {
    if std::env::var_os("CARGO_FEATURE_LOADER").is_none() {
        return;
    }
    let clang =
        std::env::var_os("TWIG_NET_CLANG").map_or_else(|| PathBuf::from("clang"), PathBuf::from);
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-env-changed=TWIG_NET_CLANG");
    println!("cargo:rerun-if-changed=bpf/pod.c");
    println!("cargo:rerun-if-changed=bpf/forward.c");
    println!("cargo:rerun-if-changed=build/compile.rs");
    for name in ["pod", "forward"] {
        let source = PathBuf::from(format!("bpf/{name}.c"));
        if let Err(message) =
            compile::compile_bpf(&clang, &source, &out_dir.join(format!("{name}.o")))
        {
            eprintln!("{message}");
            panic!("{message}");
        }
    }
}
