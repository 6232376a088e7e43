//! `scripts/install-node.sh` on this host, into a temporary root: the
//! binaries, guest files, configs, systemd units and containerd drop-in
//! land where the shim, twig-node and containerd look for them; the real
//! containerd reads the drop-in as a `twig` runtime handler and a `twig`
//! proxy snapshotter; bad input installs nothing. (Runs on the host, not in
//! the lab; needs the workspace's binaries built, as `cargo test
//! --workspace` does, and Debian's containerd.)
#![cfg(not(feature = "lab"))]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use twig_e2e::{find_on_path, run, Output};

const BINS: [&str; 4] = [
    "containerd-shim-twig-v2",
    "twig-vmm",
    "twig-node",
    "twig-snapshotter",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ has a parent")
        .to_path_buf()
}

/// A bundle (`bin/`, `share/`) of the workspace's built binaries, as
/// `install-node.sh --bundle` lays it out. The guest files are copied
/// as opaque bytes by the installer, so small stand-ins do here.
fn bundle(dir: &Path) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"))
        .join("debug");
    let b = dir.join("bundle");
    std::fs::create_dir_all(b.join("bin")).unwrap();
    std::fs::create_dir_all(b.join("share")).unwrap();
    for bin in BINS {
        let src = target.join(bin);
        assert!(
            src.is_file(),
            "{} is not built: build the workspace's binaries first (cargo build --workspace --bins)",
            src.display()
        );
        std::fs::copy(&src, b.join("bin").join(bin)).unwrap();
    }
    std::fs::write(b.join("share/vmlinux"), b"kernel").unwrap();
    std::fs::write(b.join("share/agent-initrd.cpio.gz"), b"initrd").unwrap();
    b
}

fn install(args: &[&str]) -> Output {
    run(
        twig_store::testkit::clear_cargo_test_env(&mut Command::new(
            workspace().join("scripts/install-node.sh"),
        ))
        .args(args),
        Duration::from_secs(60),
    )
    .unwrap()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir`, relative, sorted.
fn files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// `containerd config dump` of a config importing the installed drop-in.
fn containerd_dump(dir: &Path, root: &Path) -> String {
    assert!(
        find_on_path("containerd").is_some(),
        "containerd is not installed (scripts/install-deps.sh installs it)"
    );
    let config = dir.join("containerd.toml");
    std::fs::write(
        &config,
        format!(
            "version = 2\nimports = [\"{}\"]\n",
            root.join("etc/containerd/conf.d/twig.toml").display()
        ),
    )
    .unwrap();
    let out = run(
        Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .args(["config", "dump"]),
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(out.code(), Some(0), "containerd config dump: {out}");
    out.stdout
}

#[test]
fn installs_into_a_root_and_containerd_reads_the_drop_in() {
    let dir = tempfile::tempdir().unwrap();
    let from = bundle(dir.path());
    let root = dir.path().join("root");
    std::fs::create_dir_all(root.join("etc/containerd")).unwrap();
    let mine =
        "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"pause:3.9\"\n";
    std::fs::write(root.join("etc/containerd/config.toml"), mine).unwrap();
    let (from, root_s) = (from.to_str().unwrap(), root.to_str().unwrap());
    let args = [
        "--from",
        from,
        "--root",
        root_s,
        "--containerd-version",
        "1.6",
    ];
    let out = install(&args);
    assert_eq!(out.code(), Some(0), "{out}");

    assert_eq!(
        files(&root),
        [
            "etc/containerd/conf.d/twig.toml",
            "etc/containerd/config.toml",
            "etc/systemd/system/twig-node.service",
            "etc/systemd/system/twig-snapshotter.service",
            "etc/twig/node.json",
            "etc/twig/shim.json",
            "usr/local/bin/containerd-shim-twig-v2",
            "usr/local/bin/twig-node",
            "usr/local/bin/twig-snapshotter",
            "usr/local/bin/twig-vmm",
            "usr/share/twig/agent-initrd.cpio.gz",
            "usr/share/twig/vmlinux",
        ]
    );
    for bin in BINS {
        let installed = root.join("usr/local/bin").join(bin);
        assert_eq!(
            std::fs::read(&installed).unwrap(),
            std::fs::read(Path::new(from).join("bin").join(bin)).unwrap()
        );
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&installed).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o755, "{bin}");
    }
    // containerd's config: the import first, the user's config kept.
    let config = read(&root.join("etc/containerd/config.toml"));
    assert_eq!(
        config,
        format!("imports = [\"/etc/containerd/conf.d/*.toml\"]\n{mine}")
    );
    // The configs name what the daemons need, as JSON.
    let node: serde_json::Value =
        serde_json::from_str(&read(&root.join("etc/twig/node.json"))).unwrap();
    assert_eq!(node["socket"], "/run/twig/node.sock");
    assert_eq!(node["base"]["kernel"], "/usr/share/twig/vmlinux");
    let shim: serde_json::Value =
        serde_json::from_str(&read(&root.join("etc/twig/shim.json"))).unwrap();
    assert_eq!(shim["node_socket"], node["socket"]);
    let unit = read(&root.join("etc/systemd/system/twig-node.service"));
    assert!(unit.contains("ExecStart=/usr/local/bin/twig-node --config /etc/twig/node.json"));
    assert!(
        unit.contains("KillMode=process"),
        "a restart must not kill the pods' VMMs"
    );

    // The real containerd reads the drop-in: the twig handler, the proxy
    // snapshotter, and (containerd 1.6) twig as the CRI snapshotter.
    let dump = containerd_dump(dir.path(), &root);
    let handler = dump
        .split("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.twig]")
        .nth(1)
        .unwrap_or_else(|| panic!("no twig runtime in {dump}"));
    let handler = handler.split("\n\n").next().unwrap_or_default();
    assert!(
        handler.contains("runtime_type = \"io.containerd.twig.v2\""),
        "{handler}"
    );
    assert!(
        handler.contains("pod_annotations = [\"twig.dev/*\"]"),
        "{handler}"
    );
    assert!(dump.contains("[proxy_plugins.twig]\n    address = \"/run/twig/snapshotter.sock\"\n    type = \"snapshot\""), "{dump}");
    assert!(dump.contains("      snapshotter = \"twig\""), "{dump}");

    // Again: idempotent; a user's edited config stays.
    std::fs::write(root.join("etc/twig/shim.json"), "{\"call_timeout_s\": 9}").unwrap();
    let out = install(&args);
    assert_eq!(out.code(), Some(0), "{out}");
    assert_eq!(read(&root.join("etc/containerd/config.toml")), config);
    assert_eq!(
        read(&root.join("etc/twig/shim.json")),
        "{\"call_timeout_s\": 9}"
    );
    assert!(out.stderr.contains("keeping etc/twig/shim.json"), "{out}");

    // containerd 1.7 and later: a per-runtime snapshotter, the node's CRI
    // snapshotter untouched.
    let out = install(&[
        "--from",
        from,
        "--root",
        root_s,
        "--containerd-version",
        "1.7",
    ]);
    assert_eq!(out.code(), Some(0), "{out}");
    let dump = containerd_dump(dir.path(), &root);
    assert!(!dump.contains("      snapshotter = \"twig\""), "{dump}");
}

#[test]
fn bad_input_installs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let from = bundle(dir.path());
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let root_s = root.to_str().unwrap();

    // A bundle without the guest kernel.
    std::fs::remove_file(from.join("share/vmlinux")).unwrap();
    let out = install(&[
        "--from",
        from.to_str().unwrap(),
        "--root",
        root_s,
        "--containerd-version",
        "1.7",
    ]);
    assert_ne!(out.code(), Some(0), "{out}");
    assert!(out.stderr.contains("share/vmlinux is missing"), "{out}");
    assert!(files(&root).is_empty(), "{:?}", files(&root));
    std::fs::write(from.join("share/vmlinux"), b"kernel").unwrap();

    // No containerd to ask for its version.
    let out = install(&["--from", from.to_str().unwrap(), "--root", root_s]);
    assert_ne!(out.code(), Some(0), "{out}");
    assert!(out.stderr.contains("--containerd-version"), "{out}");
    assert!(files(&root).is_empty(), "{:?}", files(&root));

    // Unknown arguments and bad handler names.
    let out = install(&["--frm", "x"]);
    assert!(
        out.code() != Some(0) && out.stderr.contains("unknown argument --frm"),
        "{out}"
    );
    let out = install(&["--handler", "Bad Name", "--root", root_s]);
    assert!(
        out.code() != Some(0) && out.stderr.contains("invalid handler name"),
        "{out}"
    );

    // containerd's own imports without conf.d: refused, its config intact.
    std::fs::create_dir_all(root.join("etc/containerd")).unwrap();
    let theirs = "version = 2\nimports = [\"/etc/other/*.toml\"]\n";
    std::fs::write(root.join("etc/containerd/config.toml"), theirs).unwrap();
    let out = install(&[
        "--from",
        from.to_str().unwrap(),
        "--root",
        root_s,
        "--containerd-version",
        "1.7",
    ]);
    assert_ne!(out.code(), Some(0), "{out}");
    assert!(
        out.stderr
            .contains("imports line without /etc/containerd/conf.d"),
        "{out}"
    );
    assert_eq!(read(&root.join("etc/containerd/config.toml")), theirs);
}

#[test]
fn the_registry_section_names_the_registry_the_node_speaks_to() {
    let dir = tempfile::tempdir().unwrap();
    let from = bundle(dir.path());
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let (from, root_s) = (from.to_str().unwrap(), root.to_str().unwrap());
    let common = [
        "--from",
        from,
        "--root",
        root_s,
        "--containerd-version",
        "1.7",
    ];

    let bad = install(&[&common[..], &["--registry-host", "Evil Host"]].concat());
    assert!(
        bad.code() != Some(0) && bad.stderr.contains("invalid registry host Evil Host"),
        "{bad}"
    );
    assert!(files(&root).is_empty(), "{:?}", files(&root));
    let bad = install(&[&common[..], &["--registry-lazy-fill-kib", "-1"]].concat());
    assert!(
        bad.code() != Some(0) && bad.stderr.contains("invalid lazy-restore download pace -1"),
        "{bad}"
    );
    assert!(files(&root).is_empty(), "{:?}", files(&root));

    let out = install(
        &[
            &common[..],
            &[
                "--registry-host",
                "registry.example.com:5000",
                "--registry-prefix",
                "snap/twig",
                "--registry-lazy-fill-kib",
                "2048",
            ],
        ]
        .concat(),
    );
    assert_eq!(out.code(), Some(0), "{out}");
    let node: serde_json::Value =
        serde_json::from_str(&read(&root.join("etc/twig/node.json"))).unwrap();
    assert_eq!(
        node["registry"],
        serde_json::json!({
            "hosts": ["registry.example.com:5000"],
            "credentials": null,
            "plain_http": [],
            "repository_prefix": "snap/twig",
            "lazy_fill_kib_per_s": 2048,
        })
    );
}
