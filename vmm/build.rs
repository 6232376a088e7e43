//! Assembles the ring-3 test guest (guests/testguest.S) with binutils, as an
//! ELF image loaded at 1 MiB and as a bzImage (a minimal real-mode setup
//! header followed by the guest linked at 1 MiB + 0x200, where the 64-bit
//! boot protocol enters a bzImage).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?} (install binutils): {e}"));
    assert!(status.success(), "{cmd:?} failed: {status}");
}

fn link(obj: &Path, out: &Path, text: &str) {
    run(Command::new("ld")
        .args([
            "-N",
            "--no-warn-rwx-segments",
            "-nostdlib",
            "-static",
            &format!("-Ttext={text}"),
            "-e",
            "_start",
            "-o",
        ])
        .arg(out)
        .arg(obj));
}

fn bzimage(payload: &[u8]) -> Vec<u8> {
    const SETUP_SECTS: u8 = 4;
    let mut img = vec![0u8; (SETUP_SECTS as usize + 1) * 512];
    img[0x1f1] = SETUP_SECTS;
    img[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    img[0x202..0x206].copy_from_slice(b"HdrS");
    img[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
    img[0x211] = 1; // LOADED_HIGH
    img[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
    img.extend_from_slice(&[0u8; 0x200]);
    img.extend_from_slice(payload);
    img
}

fn main() {
    // The test guest is only built for the `testguest` feature.
    if env::var_os("CARGO_FEATURE_TESTGUEST").is_none() {
        println!("cargo:rerun-if-changed=build.rs");
        return;
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let src = "guests/testguest.S";
    println!("cargo:rerun-if-changed={src}");
    let obj = out.join("testguest.o");
    run(Command::new("as").args(["--64", "-o"]).arg(&obj).arg(src));
    let elf = out.join("testguest.elf");
    link(&obj, &elf, "0x100000");
    // The address of `parked` in the ELF image, for tests that must stop
    // the guest where it waits (not elsewhere in its idle loop).
    let nm = Command::new("nm")
        .arg(&elf)
        .output()
        .unwrap_or_else(|e| panic!("cannot run nm (install binutils): {e}"));
    assert!(nm.status.success(), "nm {} failed", elf.display());
    let symbols = String::from_utf8_lossy(&nm.stdout);
    let parked = symbols
        .lines()
        .find_map(|l| l.strip_suffix(" T parked"))
        .unwrap_or_else(|| panic!("no `parked` in the test guest's symbols:\n{symbols}"));
    std::fs::write(
        out.join("testguest_parked.rs"),
        format!(
            "/// The test guest's RIP while its vCPU waits at the idle port (ELF image).\n\
             pub const PARKED_RIP: u64 = 0x{parked};\n"
        ),
    )
    .expect("write the test guest's symbols");
    let bz_elf = out.join("testguest-bz.elf");
    let bin = out.join("testguest-bz.bin");
    link(&obj, &bz_elf, "0x100200");
    run(Command::new("objcopy")
        .args(["-O", "binary"])
        .arg(&bz_elf)
        .arg(&bin));
    let payload = std::fs::read(&bin).expect("read the flat test guest");
    std::fs::write(out.join("testguest.bzImage"), bzimage(&payload)).expect("write the bzImage");
}
