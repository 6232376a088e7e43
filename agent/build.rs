//! Generates the ttrpc client and server code for `proto/agent.proto`.

use std::path::PathBuf;

use ttrpc_codegen::{Codegen, Customize, ProtobufCustomize};

fn main() -> std::io::Result<()> {
    println!("cargo:rerun-if-changed=proto/agent.proto");
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(std::io::Error::other)?);
    Codegen::new()
        .out_dir(&out)
        .input("proto/agent.proto")
        .include("proto")
        .rust_protobuf()
        .customize(Customize::default())
        .rust_protobuf_customize(ProtobufCustomize::default().gen_mod_rs(false))
        .run()?;
    // The generated files open with inner attributes and doc comments, which
    // `include!` inside a module rejects; src/lib.rs sets the lint levels instead.
    for file in ["agent.rs", "agent_ttrpc.rs"] {
        let path = out.join(file);
        let text = std::fs::read_to_string(&path)?;
        let kept: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with("#![") && !l.starts_with("//!"))
            .collect();
        std::fs::write(&path, kept.join("\n"))?;
    }
    Ok(())
}
