//! A Redis pod for the workflow tests: Redis 7 from Debian's packages
//! (`e2e/build-image.sh` with `TWIG_IMAGE_DEBS`, built by tests/lab/run.sh
//! into `TWIG_E2E_REDIS_IMAGE`), with an append-only file in `/data` on the
//! pod's rootfs, so its state is in guest memory and on disk. The pods are
//! on the node's network (`hostNetwork`) and annotated `twig.dev/network:
//! none`, so on twig their VM has no network: no eBPF path to load (eBPF
//! verification beside nested guests provokes the lab's wedges,
//! tests/lab/README.md); Redis listens on loopback.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::ctrllab::{offline, twig_pod, until, CtrlLab, READY};

/// The Redis image's reference, as tests/lab/run.sh builds it.
pub const REDIS_REF: &str = "docker.io/library/twig-e2e-redis:v1";
/// The pod's container.
pub const CONTAINER: &str = "redis";
/// `redis-cli` in the image.
pub const CLI: &str = "/usr/bin/redis-cli";
/// Redis on the pod's loopback, its append-only file in `/data` (the
/// rootfs), fsynced at every write: what it acknowledged is on disk. Its
/// background tasks run once a second (`--hz 1`, not ten times): every
/// wake-up of an idle guest costs the lab's one emulated CPU several nested
/// exits, and a Clone of eight keeps nine guests idling.
const SERVER: &str = "mkdir -p /data && exec /usr/bin/redis-server --bind 127.0.0.1 \
     --protected-mode no --dir /data --appendonly yes --appendfsync always --save '' --hz 1";

/// The Redis image's OCI archive (`TWIG_E2E_REDIS_IMAGE`).
pub fn image() -> PathBuf {
    PathBuf::from(std::env::var_os("TWIG_E2E_REDIS_IMAGE").unwrap_or_else(|| {
        panic!(
            "TWIG_E2E_REDIS_IMAGE is not set: run this test through tests/lab/run.sh, which \
             builds the Redis image with e2e/build-image.sh"
        )
    }))
}

/// The Redis pod `name`, on the node's network.
pub fn pod(name: &str) -> Pod {
    let mut pod = twig_pod(
        name,
        Container {
            name: CONTAINER.into(),
            image: Some(REDIS_REF.into()),
            command: Some(vec!["/bin/sh".into(), "-c".into()]),
            args: Some(vec![SERVER.into()]),
            ..Default::default()
        },
    );
    offline(&mut pod);
    pod
}

/// `redis-cli args…` in container `id`: its output, which must exit 0.
pub async fn cli(lab: &CtrlLab, id: &str, args: &[&str]) -> String {
    let argv: Vec<&str> = std::iter::once(CLI).chain(args.iter().copied()).collect();
    let (code, out) = lab.exec(id, &argv).await;
    assert_eq!(code, 0, "redis-cli {args:?} in {id}: {out}");
    out
}

/// Waits until Redis in container `id` answers.
pub async fn answering(lab: &CtrlLab, id: &str) {
    until(&format!("Redis in {id} to answer"), READY, || async {
        let (code, out) = lab.exec(id, &[CLI, "ping"]).await;
        (code == 0 && out == "PONG").then_some(())
    })
    .await;
}

/// The number of keys in container `id`'s Redis.
pub async fn dbsize(lab: &CtrlLab, id: &str) -> usize {
    let out = cli(lab, id, &["dbsize"]).await;
    out.parse()
        .unwrap_or_else(|e| panic!("DBSIZE of {id} said {out:?}: {e}"))
}

/// Writes `key1…keyN` = `value1…valueN` and the file `/data/notes` in
/// container `id`, synced to disk.
pub async fn write_keys(lab: &CtrlLab, id: &str, keys: usize) {
    let (code, out) = lab
        .sh(
            id,
            &format!(
                "for i in $(seq 1 {keys}); do {CLI} set key$i value$i >/dev/null || exit 1; done; \
                 echo notes > /data/notes && sync"
            ),
        )
        .await;
    assert_eq!(code, 0, "writing the keys: {out}");
    assert_eq!(dbsize(lab, id).await, keys);
}
