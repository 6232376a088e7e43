//! Compiles `agent.proto`, `twig.proto` and `node.proto` with ttrpc-codegen, once per
//! flavour the enabled features ask for: `$OUT_DIR/sync/` (messages, always,
//! plus the sync ttrpc code) and `$OUT_DIR/async/` (the async ttrpc code,
//! with feature `async`).

use std::path::{Path, PathBuf};

use ttrpc_codegen::{Codegen, Customize, ProtobufCustomize};

const PROTOS: [&str; 3] = ["agent.proto", "twig.proto", "node.proto"];

fn generate(out: &Path, customize: Customize) -> std::io::Result<()> {
    std::fs::create_dir_all(out)?;
    Codegen::new()
        .out_dir(out)
        .inputs(PROTOS)
        .include(".")
        .rust_protobuf()
        .customize(customize)
        .rust_protobuf_customize(ProtobufCustomize::default().gen_mod_rs(false))
        .run()?;
    // The generated files open with inner attributes and doc comments, which
    // `include!` inside a module rejects; src/lib.rs sets the lint levels instead.
    for entry in std::fs::read_dir(out)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path)?;
            let kept: Vec<&str> = text
                .lines()
                .filter(|l| !l.starts_with("#![") && !l.starts_with("//!"))
                .collect();
            std::fs::write(&path, kept.join("\n"))?;
        }
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(std::io::Error::other)?);
    generate(&out.join("sync"), Customize::default())?;
    if std::env::var_os("CARGO_FEATURE_ASYNC").is_some() {
        generate(
            &out.join("async"),
            Customize {
                async_all: true,
                ..Default::default()
            },
        )?;
    }
    Ok(())
}
