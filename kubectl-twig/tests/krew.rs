//! The krew manifest (`krew/twig.yaml`) is a plugin manifest krew accepts
//! once the release adds each platform's `uri` and `sha256`.

use serde_json::Value;

#[test]
fn krew_manifest_is_complete_but_for_what_the_release_adds() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/krew/twig.yaml");
    let text = std::fs::read_to_string(path).expect("read the manifest");
    let manifest: Value = serde_saphyr::from_str(&text).expect("the manifest is YAML");
    assert_eq!(
        manifest["apiVersion"],
        "krew.googlecontainertools.github.com/v1alpha2"
    );
    assert_eq!(manifest["kind"], "Plugin");
    // krew's rule: the plugin's name is the file's name, and `kubectl <name>` runs it.
    assert_eq!(manifest["metadata"]["name"], "twig");
    let spec = &manifest["spec"];
    assert_eq!(
        spec["version"],
        format!("v{}", env!("CARGO_PKG_VERSION")),
        "the manifest's version follows the crate's"
    );
    for field in ["shortDescription", "description", "caveats"] {
        assert!(
            spec[field].as_str().is_some_and(|s| !s.trim().is_empty()),
            "{field}"
        );
    }
    let platforms = spec["platforms"].as_array().expect("platforms");
    let selectors: Vec<(&str, &str)> = platforms
        .iter()
        .map(|p| {
            let labels = &p["selector"]["matchLabels"];
            (
                labels["os"].as_str().expect("os"),
                labels["arch"].as_str().expect("arch"),
            )
        })
        .collect();
    assert_eq!(selectors, [("linux", "amd64"), ("linux", "arm64")]);
    for platform in platforms {
        assert_eq!(platform["bin"], "kubectl-twig");
        assert_eq!(
            platform["files"],
            serde_json::json!([{"from": "kubectl-twig", "to": "."}])
        );
        // What the release adds, when present, is well formed.
        if let Some(uri) = platform.get("uri") {
            assert!(
                uri.as_str().is_some_and(|u| u.starts_with("https://")),
                "{uri}"
            );
        }
        if let Some(sha) = platform.get("sha256") {
            assert!(
                sha.as_str()
                    .is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())),
                "{sha}"
            );
        }
    }
}
