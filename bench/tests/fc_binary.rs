//! `twig-bench fc` needs a Firecracker binary (built by hand with
//! scripts/build-firecracker.sh, never in CI): without a usable one it stops
//! at once, non-zero, saying what is missing, before it touches /dev/kvm.

use std::process::{Command, Output};

fn fc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_twig-bench"))
        .arg("fc")
        .args(args)
        .env_remove("TWIG_FIRECRACKER")
        .output()
        .expect("running twig-bench")
}

fn fails_saying(out: &Output, what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exit {:?}, stderr {err}", out.status);
    assert!(err.contains(what), "stderr lacks {what:?}: {err}");
    assert!(out.stdout.is_empty(), "stdout: {:?}", out.stdout);
}

#[test]
fn fc_mode_fails_loudly_without_its_binary() {
    fails_saying(&fc(&[]), "no Firecracker binary: pass --firecracker PATH");
    fails_saying(
        &fc(&["--firecracker", "/nonexistent/firecracker"]),
        "Firecracker binary /nonexistent/firecracker: No such file",
    );
    let dir = tempfile::tempdir().expect("a temporary directory");
    let d = dir.path().display().to_string();
    fails_saying(
        &fc(&["--firecracker", &d]),
        &format!("Firecracker binary {d} is not an executable file"),
    );
    let plain = dir.path().join("firecracker");
    std::fs::write(&plain, b"not a program").expect("writing a plain file");
    let p = plain.display().to_string();
    fails_saying(
        &fc(&["--firecracker", &p, "--json"]),
        &format!("Firecracker binary {p} is not an executable file"),
    );
}
