//! The commands that create a Twig object: `snapshot`, `fork` and `rewind`.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, ObjectMeta, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use twig_controller::crd::{
    CloneSource, CloneSpec, DeletionPolicy, PodClone, Rollback, RollbackSpec, Snapshot,
    SnapshotMode, SnapshotSpec, RUNTIME_CLASS,
};

use crate::cli::{ForkArgs, Mode, Output, RewindArgs, SnapshotArgs};
use crate::error::Error;
use crate::kind::Kind;
use crate::output::{emit, print, table};
use crate::wait::{self, Target};

/// `kubectl twig snapshot POD`.
pub async fn snapshot(client: Client, namespace: &str, args: SnapshotArgs) -> Result<(), Error> {
    let pod_uid = require_pod(&client, namespace, &args.pod)
        .await?
        .metadata
        .uid;
    let spec = SnapshotSpec {
        pod_name: args.pod.clone(),
        pod_uid,
        mode: match args.mode {
            Mode::Incremental => SnapshotMode::Incremental,
            Mode::Full => SnapshotMode::Full,
        },
        deletion_policy: DeletionPolicy::Delete,
        ttl_seconds_after_ready: args.ttl,
        failure_deadline_seconds: None,
        export: args.export,
    };
    let snapshot = Snapshot {
        metadata: metadata(args.name, &format!("{}-", args.pod)),
        spec,
        status: None,
    };
    let created = create(&client, namespace, &snapshot).await?;
    created_then_wait(
        &client,
        namespace,
        Kind::Snapshot,
        &created,
        args.output,
        args.wait.wait,
    )
    .await
    .map(drop)
}

/// `kubectl twig fork (POD | --from-snapshot SNAP) --replicas N`.
pub async fn fork(client: Client, namespace: &str, args: ForkArgs) -> Result<(), Error> {
    let (source, from) = match (args.pod, args.from_snapshot) {
        (Some(pod), None) => {
            require_pod(&client, namespace, &pod).await?;
            let source = CloneSource {
                pod_name: Some(pod.clone()),
                snapshot_name: None,
            };
            (source, pod)
        }
        (None, Some(snapshot)) => {
            Api::<Snapshot>::namespaced(client.clone(), namespace)
                .get(&snapshot)
                .await?;
            let source = CloneSource {
                pod_name: None,
                snapshot_name: Some(snapshot.clone()),
            };
            (source, snapshot)
        }
        _ => {
            return Err(Error::Usage(
                "name either a POD or --from-snapshot SNAPSHOT, not both".into(),
            ))
        }
    };
    let clone = PodClone {
        metadata: metadata(args.name, &format!("{from}-fork-")),
        spec: CloneSpec {
            source,
            replicas: args.replicas,
            name_prefix: None,
            labels: None,
            failure_deadline_seconds: None,
        },
        status: None,
    };
    let created = create(&client, namespace, &clone).await?;
    let Some(done) = created_then_wait(
        &client,
        namespace,
        Kind::Clone,
        &created,
        args.output,
        args.wait.wait,
    )
    .await?
    else {
        return Ok(());
    };
    if !matches!(args.output, None | Some(Output::Name)) {
        return Ok(());
    }
    let pod_names: Vec<String> = done.data["status"]["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_str().map(str::to_string))
        .collect();
    if args.output == Some(Output::Name) {
        let lines: String = pod_names.iter().map(|p| format!("pod/{p}\n")).collect();
        return print(&lines);
    }
    let pods = Api::<Pod>::namespaced(client, namespace);
    let mut rows = vec![["NAME", "READY", "STATUS", "NODE", "IP"]
        .map(String::from)
        .to_vec()];
    for name in pod_names {
        // A pod deleted since (the Clone makes it again) is shown as such.
        let Some(pod) = pods.get_opt(&name).await? else {
            rows.push(vec![
                name,
                "-".into(),
                "NotFound".into(),
                "-".into(),
                "-".into(),
            ]);
            continue;
        };
        let status = pod.status.unwrap_or_default();
        let containers = status.container_statuses.unwrap_or_default();
        let ready = containers.iter().filter(|c| c.ready).count();
        rows.push(vec![
            name,
            format!("{ready}/{}", containers.len()),
            status.phase.unwrap_or_else(|| "Unknown".into()),
            pod.spec
                .and_then(|s| s.node_name)
                .unwrap_or_else(|| "<none>".into()),
            status.pod_ip.unwrap_or_else(|| "<none>".into()),
        ]);
    }
    print(&table(&rows))
}

/// `kubectl twig rewind POD --to SNAPSHOT`.
pub async fn rewind(client: Client, namespace: &str, args: RewindArgs) -> Result<(), Error> {
    let pod_uid = require_pod(&client, namespace, &args.pod)
        .await?
        .metadata
        .uid;
    Api::<Snapshot>::namespaced(client.clone(), namespace)
        .get(&args.to)
        .await?;
    let rollback = Rollback {
        metadata: metadata(args.name, &format!("{}-rewind-", args.pod)),
        spec: RollbackSpec {
            pod_name: args.pod.clone(),
            snapshot_name: args.to,
            pod_uid,
            safety_snapshot: !args.no_safety_snapshot,
            failure_deadline_seconds: None,
        },
        status: None,
    };
    let created = create(&client, namespace, &rollback).await?;
    let done = created_then_wait(
        &client,
        namespace,
        Kind::Rollback,
        &created,
        args.output,
        args.wait.wait,
    )
    .await?;
    let safety = done
        .as_ref()
        .and_then(|d| d.data["status"]["safetySnapshotName"].as_str());
    match (safety, args.output) {
        (Some(safety), None) => print(&format!(
            "safety snapshot: {} (undo: kubectl twig rewind {} --to {safety})\n",
            Kind::Snapshot.object_name(safety),
            args.pod
        )),
        _ => Ok(()),
    }
}

/// The pod must exist (its absence is the server's NotFound, as kubectl
/// prints it) and be a Twig pod, as the controller requires. The pod, whose
/// UID a new object pins (a pod recreated under the name since is refused).
pub async fn require_pod(client: &Client, namespace: &str, pod: &str) -> Result<Pod, Error> {
    let found = Api::<Pod>::namespaced(client.clone(), namespace)
        .get(pod)
        .await?;
    let runtime_class = found
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref());
    if runtime_class != Some(RUNTIME_CLASS) {
        return Err(Error::Usage(format!(
            "pod {pod} is not a Twig pod: its runtimeClassName is {}, not {RUNTIME_CLASS}",
            runtime_class.unwrap_or("unset")
        )));
    }
    Ok(found)
}

/// `name`, or a name the server generates from `prefix`.
fn metadata(name: Option<String>, prefix: &str) -> ObjectMeta {
    match name {
        Some(name) => ObjectMeta {
            name: Some(name),
            ..ObjectMeta::default()
        },
        None => ObjectMeta {
            generate_name: Some(prefix.to_string()),
            ..ObjectMeta::default()
        },
    }
}

async fn create<K>(client: &Client, namespace: &str, obj: &K) -> Result<K, Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + Serialize
        + DeserializeOwned,
    K::DynamicType: Default,
{
    Ok(Api::<K>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), obj)
        .await?)
}

/// Says the object was created and, with `--wait`, waits until it is Ready
/// (its failure is an error); the object as last seen when it waited.
async fn created_then_wait<K: Serialize + ResourceExt>(
    client: &Client,
    namespace: &str,
    kind: Kind,
    created: &K,
    output: Option<Output>,
    wait: Option<Duration>,
) -> Result<Option<DynamicObject>, Error> {
    let name = created.name_any();
    let object = kind.object_name(&name);
    let created_line = format!("{object} created");
    let Some(timeout) = wait else {
        emit(output, &object, created, &created_line)?;
        return Ok(None);
    };
    match output {
        None => print(&format!("{created_line}\n"))?,
        Some(Output::Name) => print(&format!("{object}\n"))?,
        Some(Output::Json | Output::Yaml) => {}
    }
    let api = kind.api(client.clone(), namespace);
    let done = wait::until(kind, &api, &name, &Target::ready(), timeout)
        .await?
        .ok_or_else(|| Error::NotFound(format!("{object} was deleted while waiting")))?;
    match output {
        None => print(&format!("{object} ready\n"))?,
        Some(Output::Name) => {}
        Some(format) => emit(Some(format), &object, &done, "")?,
    }
    Ok(Some(done))
}
