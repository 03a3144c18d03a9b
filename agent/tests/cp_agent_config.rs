//! The agent config: the example in deploy/ parses, and `coordinator_shards` is read.

use drum_agent::AgentSettings;
use std::path::Path;

#[test]
fn deploy_example_parses_and_shards_are_read() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/agent.toml");
    let (s, o) = AgentSettings::load_with_options(&example).unwrap();
    assert_eq!(s.host, "h0");
    assert!(o.coordinator_shards.is_empty());
    let dir = tempfile::tempdir().unwrap();
    let write = |extra: &str| {
        let p = dir.path().join("a.toml");
        std::fs::write(
            &p,
            format!(
                "host = \"h0\"\ninstance = \"i.json\"\ncoordinator = \"127.0.0.1:7400\"\n{extra}\n\
                 [tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n"
            ),
        )
        .unwrap();
        p
    };
    let (_, o) = AgentSettings::load_with_options(&write(
        "coordinator_shards = [\"127.0.0.1:7401\", \"127.0.0.1:7402\"]",
    ))
    .unwrap();
    assert_eq!(o.coordinator_shards.len(), 2);
    assert!(!o.apps_from_shims);
    for (extra, want) in [
        (
            "coordinator_shard = []",
            "unknown field `coordinator_shard`",
        ),
        (
            "coordinator_shards = [\"nowhere\"]",
            "invalid socket address",
        ),
        ("apps_from_shims = true", "apps_from_shims in"),
    ] {
        let e = AgentSettings::load_with_options(&write(extra)).unwrap_err();
        assert!(format!("{e:#}").contains(want), "{extra}: {e:#}");
    }
}
