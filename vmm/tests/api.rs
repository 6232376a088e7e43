//! The `twig-vmm` binary: its JSON API on a Unix socket, driven by a client
//! the way the shim will, with the process started and stopped by PID.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use common::*;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_twig-vmm");

struct Vmm {
    child: Child,
    conn: BufReader<UnixStream>,
}

impl Vmm {
    fn start(dir: &Path, name: &str, extra: &[&str]) -> Vmm {
        let sock = dir.join(format!("{name}.sock"));
        let child = Command::new(BIN)
            .args(["serve", "--api-sock"])
            .arg(&sock)
            .arg("--serial")
            .arg(dir.join(format!("{name}.serial")))
            .args(extra)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn twig-vmm");
        let deadline = Instant::now() + T;
        let conn = loop {
            match UnixStream::connect(&sock) {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => panic!("twig-vmm did not listen: {e}"),
                Err(_) => std::thread::yield_now(),
            }
        };
        Vmm {
            child,
            conn: BufReader::new(conn),
        }
    }

    fn call(&mut self, req: &str) -> Value {
        writeln!(self.conn.get_mut(), "{req}").unwrap();
        let mut line = String::new();
        self.conn.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad response {line:?}: {e}"))
    }

    fn ok(&mut self, req: Value) -> Value {
        let r = self.call(&req.to_string());
        assert_eq!(r["ok"], true, "{req} -> {r}");
        r["result"].clone()
    }

    fn err(&mut self, req: &str) -> String {
        let r = self.call(req);
        assert_eq!(r["ok"], false, "{req} -> {r}");
        r["error"].as_str().unwrap().to_string()
    }

    fn shutdown(mut self) {
        self.ok(json!({"op": "shutdown"}));
        let deadline = Instant::now() + T;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "twig-vmm exited with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "twig-vmm did not exit");
            std::thread::yield_now();
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_file(path: &Path, pat: &str) {
    let deadline = Instant::now() + T;
    loop {
        let s = std::fs::read_to_string(path).unwrap_or_default();
        if s.contains(pat) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} never showed {pat:?}: {s:?}",
            path.display()
        );
        std::thread::yield_now();
    }
}

#[test]
fn boot_snapshot_rollback_restore_over_the_api() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let mut a = Vmm::start(d.path(), "a", &[]);
    assert!(a.err(r#"{"op":"stats"}"#).contains("no VM yet"));
    a.ok(json!({"op":"boot","kernel":kernel,"mem_mib":MIB,"vcpus":2}));
    wait_file(&d.path().join("a.serial"), "B");
    let e = a.err(&json!({"op":"boot","kernel":kernel}).to_string());
    assert!(e.contains("already has a VM"), "{e}");
    // The shim's way: the node store hands out a staging directory, the
    // VMM writes into it, the store publishes.
    let store = twig_store::NodeStore::open(&d.path().join("store"), true).unwrap();
    let staging = store.stage("s1").unwrap();
    let r = a.ok(json!({"op":"snapshot","dir":staging.dir(),"kind":"full"}));
    assert_eq!(r["kind"], "full");
    assert_eq!(r["id"], "s1");
    let s1 = staging.publish().unwrap().dir().to_path_buf();
    let staging = store.stage("s2").unwrap();
    let r = a.ok(json!({"op":"snapshot","dir":staging.dir(),"kind":"incremental"}));
    assert_eq!(r["parent"], "s1");
    let s2 = staging.publish().unwrap();
    assert_eq!(s2.parent.as_deref(), Some("s1"));
    assert_eq!(s2.kind, twig_store::Kind::Incremental);
    let r = a.ok(json!({"op":"rollback","dir":s1}));
    assert_eq!(r["remapped"], false);
    a.ok(json!({"op":"pause"}));
    let st = a.ok(json!({"op":"stats"}));
    assert_eq!(st["state"], "paused");
    assert_eq!(st["vcpus"], 2);
    a.ok(json!({"op":"resume"}));

    // A second process, with a VM prepared ahead of time, restores s1.
    let mut b = Vmm::start(
        d.path(),
        "b",
        &[
            "--prepare-mem-mib",
            &MIB.to_string(),
            "--prepare-vcpus",
            "2",
        ],
    );
    b.ok(json!({"op":"restore","dir":s1}));
    let st = b.ok(json!({"op":"stats"}));
    assert_eq!(st["state"], "running");
    assert_eq!(st["baseline"], "s1");
    b.shutdown();
    a.shutdown();

    let out = Command::new(BIN).arg("verify").arg(&s1).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"kind\": \"full\""));
}

#[test]
fn disks_and_devices_from_the_command_line_follow_snapshots() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let rw = d.path().join("rw.img");
    std::fs::write(&rw, vec![0x5a; 1 << 20]).unwrap();
    let ro = d.path().join("ro.img");
    std::fs::write(&ro, vec![0x11; 64 * 1024]).unwrap();
    let ro_arg = format!("{}:ro", ro.display());
    let mut a = Vmm::start(
        d.path(),
        "a",
        &["--disk", rw.to_str().unwrap(), "--disk", &ro_arg],
    );
    a.ok(json!({"op":"boot","kernel":kernel,"mem_mib":MIB}));
    wait_file(&d.path().join("a.serial"), "B");
    let store = twig_store::NodeStore::open(&d.path().join("store"), true).unwrap();
    let staging = store.stage("s1").unwrap();
    a.ok(json!({"op":"snapshot","dir":staging.dir(),"kind":"full"}));
    let s1 = staging.publish().unwrap().dir().to_path_buf();
    assert!(std::fs::read(s1.join("disk0")).unwrap() == std::fs::read(&rw).unwrap());
    assert!(!s1.join("disk1").exists());
    a.shutdown();

    // Restored in another process with its own disk file.
    let rw2 = d.path().join("rw2.img");
    std::fs::write(&rw2, vec![0u8; 512]).unwrap();
    let mut b = Vmm::start(
        d.path(),
        "b",
        &["--disk", rw2.to_str().unwrap(), "--disk", &ro_arg],
    );
    b.ok(json!({"op":"restore","dir":s1}));
    assert!(std::fs::read(&rw2).unwrap() == std::fs::read(&rw).unwrap());
    b.shutdown();

    // Without the disks, the snapshot does not fit.
    let mut c = Vmm::start(d.path(), "c", &[]);
    let e = c.err(&json!({"op":"restore","dir":s1}).to_string());
    assert!(e.contains("virtio devices differ"), "{e}");
    c.shutdown();
    // A missing image is named when the VM is made.
    let mut m = Vmm::start(d.path(), "m", &["--disk", "/nonexistent/disk.img"]);
    let e = m.err(&json!({"op":"boot","kernel":kernel,"mem_mib":MIB}).to_string());
    assert!(e.contains("/nonexistent/disk.img"), "{e}");
    m.shutdown();

    for bad in [
        vec!["--tap", "t0", "--mac", "aa:bb"],
        vec!["--tap", "t0", "--mac", "01:00:00:00:00:01"],
        vec!["--mac", "02:00:00:00:00:01"],
        vec!["--vsock-cid", "5"],
    ] {
        let out = Command::new(BIN)
            .args(["serve", "--api-sock", "/nonexistent/x.sock"])
            .args(&bad)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad:?}");
        assert!(!out.stderr.is_empty(), "{bad:?}");
    }
}

#[test]
fn bad_requests_get_clear_errors() {
    require_kvm();
    let d = tmp();
    let mut a = Vmm::start(d.path(), "a", &[]);
    assert!(a.err("not json").contains("bad request"));
    assert!(a.err(r#"{"op":"fly"}"#).contains("unknown variant"));
    assert!(a.err(r#"{"op":"restore"}"#).contains("missing field `dir`"));
    assert!(a
        .err(r#"{"op":"pause","extra":1}"#)
        .contains("unknown field"));
    let e = a.err(r#"{"op":"restore","dir":"/nonexistent/snap"}"#);
    assert!(e.contains("cannot open the state file"), "{e}");
    let e = a.err(r#"{"op":"boot","kernel":"/etc/hostname","mem_mib":64}"#);
    assert!(e.contains("neither an ELF vmlinux"), "{e}");
    let e = a.err(r#"{"op":"boot","kernel":"/etc/hostname","mem_mib":5}"#);
    assert!(e.contains("multiple of 2 MiB"), "{e}");
    // An oversized request gets an error and the connection is closed.
    let long = format!("{{\"op\":\"stats\",\"x\":\"{}\"}}\n", "a".repeat(70_000));
    let _ = a.conn.get_mut().write_all(long.as_bytes());
    let mut line = String::new();
    a.conn.read_line(&mut line).unwrap();
    assert!(line.contains("longer than"), "{line}");
    let deadline = Instant::now() + T;
    a.conn = loop {
        match UnixStream::connect(d.path().join("a.sock")) {
            Ok(c) => break BufReader::new(c),
            Err(e) if Instant::now() > deadline => panic!("reconnect: {e}"),
            Err(_) => std::thread::yield_now(),
        }
    };
    a.shutdown();

    let out = Command::new(BIN)
        .arg("verify")
        .arg(d.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot open the state file"));
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("serve"));
}

#[test]
fn missing_or_forbidden_kvm_is_reported() {
    require_kvm();
    let d = tmp();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let boot = json!({"op":"boot","kernel":kernel,"mem_mib":MIB}).to_string();
    let run = |name: &str, argv: &dyn Fn(&str) -> Vec<String>| -> String {
        let sock = d.path().join(format!("{name}.sock"));
        let serve = format!(
            "{BIN} serve --api-sock {} --serial /dev/null",
            sock.display()
        );
        let args = argv(&serve);
        let mut child = Command::new(&args[0]).args(&args[1..]).spawn().unwrap();
        let deadline = Instant::now() + T;
        let mut conn = loop {
            match UnixStream::connect(&sock) {
                Ok(c) => break BufReader::new(c),
                Err(e) if Instant::now() > deadline => panic!("no socket: {e}"),
                Err(_) => std::thread::yield_now(),
            }
        };
        writeln!(conn.get_mut(), "{boot}").unwrap();
        let mut line = String::new();
        conn.read_line(&mut line).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        line
    };
    // /dev/kvm replaced by /dev/null in a private mount namespace.
    let r = run("nokvm", &|serve| {
        let script = format!("mount --bind /dev/null /dev/kvm && exec {serve}");
        ["unshare", "-m", "sh", "-c", &script]
            .map(String::from)
            .to_vec()
    });
    assert!(r.contains("not a usable KVM device"), "{r}");
    // An unprivileged user.
    std::fs::set_permissions(
        d.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let r = run("nobody", &|serve| {
        let mut v: Vec<String> = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ]
        .map(String::from)
        .to_vec();
        v.extend(serve.split(' ').map(String::from));
        v
    });
    assert!(
        r.contains("cannot open /dev/kvm") && r.contains("ermission"),
        "{r}"
    );
}

#[test]
fn a_vmm_killed_mid_snapshot_leaves_no_valid_looking_snapshot() {
    require_kvm();
    let d = tmp();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let root = d.path().join("store");
    let store = twig_store::NodeStore::open(&root, true).unwrap();
    let mut a = Vmm::start(d.path(), "a", &[]);
    a.ok(json!({"op":"boot","kernel":kernel,"mem_mib":2048}));
    let staging = store.stage("big").unwrap();
    writeln!(
        a.conn.get_mut(),
        "{}",
        json!({"op":"snapshot","dir":staging.dir(),"kind":"full"})
    )
    .unwrap();
    // Kill the VMM as soon as the snapshot is being written.
    let deadline = Instant::now() + T;
    while !staging.dir().join("memory").exists() {
        assert!(Instant::now() < deadline, "the snapshot never started");
        std::thread::yield_now();
    }
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    // The VMM publishes nothing itself: the store does, once the writer
    // answers, and this one never did. The staging goes with its holder.
    assert!(store.list().unwrap().is_empty(), "nothing published");
    drop(staging);
    assert!(matches!(
        store.get("big"),
        Err(twig_store::Error::NotFound(_))
    ));
    assert_eq!(std::fs::read_dir(root.join("tmp")).unwrap().count(), 0);
    let e = twig_vmm::snapshot::verify(&store.snapshot_dir("big"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot open the state file"), "{e}");
    // The store still takes a snapshot under that id.
    let mut b = Vmm::start(d.path(), "b", &[]);
    b.ok(json!({"op":"boot","kernel":kernel,"mem_mib":MIB}));
    let staging = store.stage("big").unwrap();
    b.ok(json!({"op":"snapshot","dir":staging.dir(),"kind":"full"}));
    let s = staging.publish().unwrap();
    twig_vmm::snapshot::verify(s.dir()).unwrap();
    b.shutdown();
}

#[test]
fn template_refuses_without_vsock_and_fails_when_the_guest_never_listens() {
    require_kvm();
    let d = tempfile::tempdir().unwrap();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let out = |args: &[&str]| {
        Command::new(BIN)
            .arg("template")
            .args(args)
            .env("TWIG_LOG", "error")
            .output()
            .unwrap()
    };
    let tpl = d.path().join("store/snapshots/tpl");
    let kernel = kernel.to_str().unwrap();
    let tpl_s = tpl.to_str().unwrap();

    // A template lands in a node store: <store>/snapshots/<id>.
    let o = out(&[d.path().join("tpl").to_str().unwrap(), "--kernel", kernel]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not a snapshot directory of a store"), "{err}");

    let o = out(&[tpl_s, "--kernel", kernel, "--mem-mib", "64"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("needs --vsock-uds"), "{err}");

    // The test guest never accepts vsock connections: not ready in time.
    let uds = d.path().join("tpl.vsock");
    let t = Instant::now();
    let o = out(&[
        tpl_s,
        "--kernel",
        kernel,
        "--mem-mib",
        "64",
        "--serial",
        "/dev/null",
        "--vsock-uds",
        uds.to_str().unwrap(),
        "--timeout-s",
        "1",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not ready within"), "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(30));
    assert!(!tpl.exists(), "nothing is written");
    assert_eq!(
        std::fs::read_dir(d.path().join("store/tmp"))
            .unwrap()
            .count(),
        0,
        "nor staged"
    );
}
