//! A host directory in a pod (hostPath, a filesystem PVC), twig against
//! runc in one run (`twig-bench cri --shared-dir`): one pod per handler
//! binds a directory of the node on `/data`, and each round runs, through
//! CRI's ExecSync, the workloads below in order, timed from the host (the
//! exec's own cost is the `exec_baseline` row). Under runc the container
//! reaches the host's filesystem directly; under twig every operation is a
//! 9P2000.L round trip over vsock to the jailed file server
//! (shim README, "Filesystem volumes").

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use twig_cri::{container_config, pod_sandbox_config, CriClient};

use crate::cri::summary;
use crate::stats::{Context, Error, Report};

/// The workloads of a round: (row, shell script in the container). Sized
/// for the nested lab, where every vsock packet of a twig pod crosses
/// TCG-emulated VM exits.
const WORKLOADS: [(&str, &str); 6] = [
    ("exec_baseline", "true"),
    (
        "write_8mib",
        "dd if=/dev/zero of=/data/big bs=64k count=128 conv=fsync 2>/dev/null",
    ),
    (
        "read_8mib",
        "dd if=/data/big of=/dev/null bs=64k 2>/dev/null",
    ),
    (
        "create_100_files",
        "mkdir /data/t && cd /data/t && for d in 1 2 3 4 5 6 7 8 9 10; do mkdir d$d && \
         for f in 1 2 3 4 5 6 7 8 9 10; do echo x > d$d/f$f; done; done",
    ),
    ("stat_100_files", "ls -lR /data/t > /dev/null"),
    ("remove_all", "rm -rf /data/t /data/big"),
];

/// How long one workload may take.
const DEADLINE: Duration = Duration::from_secs(300);

/// Runs `rounds` rounds per handler (`handlers`, the first the baseline of
/// the ratios) in pods whose `/data` is a directory under `dir`.
pub async fn measure(
    r: &mut Report,
    cri: &CriClient,
    image: &str,
    handlers: &[String],
    dir: &Path,
    rounds: usize,
) -> Result<(), Error> {
    let mut pods = Vec::new();
    for h in handlers {
        let name = format!("shared-dir-{h}");
        let (host, logs) = (dir.join(&name).join("data"), dir.join(&name).join("logs"));
        for d in [&host, &logs] {
            std::fs::create_dir_all(d).context(|| format!("creating {}", d.display()))?;
        }
        let pod = pod_sandbox_config(&name, &name, &logs);
        let mut config = container_config("app", image, &["/bin/sleep", "3600"], "app.log");
        config.mounts = vec![twig_cri::api::Mount {
            container_path: "/data".into(),
            host_path: host.display().to_string(),
            ..Default::default()
        }];
        let pod_id = cri.run_pod_sandbox(&pod, h).await?;
        let id = cri.create_container(&pod_id, &config, &pod).await?;
        cri.start_container(&id).await?;
        pods.push((h.clone(), pod_id, id));
    }
    let mut samples = vec![vec![Vec::new(); WORKLOADS.len()]; pods.len()];
    for _ in 0..rounds {
        for (p, (h, _, id)) in pods.iter().enumerate() {
            for (w, (row, script)) in WORKLOADS.iter().enumerate() {
                let t0 = Instant::now();
                let out = cri.exec_sync(id, &["sh", "-c", script], DEADLINE).await?;
                let took = t0.elapsed();
                if out.exit_code != 0 {
                    return Err(format!(
                        "{row} with handler {h}: exit {}: {}",
                        out.exit_code,
                        String::from_utf8_lossy(&out.stderr)
                    )
                    .into());
                }
                samples[p][w].push(took);
            }
        }
    }
    for (p, (h, pod_id, _)) in pods.iter().enumerate() {
        for (w, (row, _)) in WORKLOADS.iter().enumerate() {
            let (s, _) = summary(r, &format!("shared_dir_{h}_{row}_ms"), &samples[p][w]);
            if p > 0 {
                let base = crate::stats::Summary::of(&samples[0][w]).p50;
                r.value(
                    &format!("ratio_shared_dir_{row}_{h}_over_{}", pods[0].0),
                    json!(s.p50 / base),
                );
            }
        }
        cri.stop_pod_sandbox(pod_id).await?;
        cri.remove_pod_sandbox(pod_id).await?;
    }
    Ok(())
}
