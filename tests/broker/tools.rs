//! Host tools: channel and speaker bound by the broker, argument validation, unknown tools and
//! routes.

use super::*;

#[tokio::test]
async fn host_tool_runs_with_channel_and_speaker() {
    let (seen, broker) = weather_broker().await;
    let (tools, mcp) = broker.turn_tools();
    assert_eq!(tools.len(), 1);
    assert_eq!(tools[0].name, "weather");
    assert!(mcp.is_empty());
    let turn = start_turn(&broker).await;
    let a = post_json(
        turn.socket(),
        "/v1/tools/weather",
        &json!({"city": "Oslo", "days": 2}),
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.json(),
        json!({"ok": true, "content": "sunny in Oslo (channel chan-1, asked by Ann u-17)"})
    );
    assert_eq!(
        seen.lock().unwrap().clone(),
        vec![("chan-1".to_owned(), speaker())]
    );
    // A handler's error is a readable result; a key in a result is redacted.
    let a = post_json(
        turn.socket(),
        "/v1/tools/weather",
        &json!({"city": "Atlantis"}),
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.json(),
        json!({"ok": false, "error": "no forecast for Atlantis"})
    );
    let a = post_json(turn.socket(), "/v1/tools/weather", &json!({"city": "Leak"})).await;
    assert_eq!(
        a.json(),
        json!({"ok": true, "content": "the key is [redacted]"})
    );
}

#[tokio::test]
async fn host_tool_invalid_arguments_give_400_naming_the_property() {
    let (seen, broker) = weather_broker().await;
    let turn = start_turn(&broker).await;
    let s = turn.socket();
    let a = post_json(s, "/v1/tools/weather", &json!({"city": 42})).await;
    assert_eq!(a.status, 400);
    assert_eq!(
        a.error(),
        r#"invalid arguments at /city: value is not of type "string""#
    );
    let a = post_json(s, "/v1/tools/weather", &json!({"days": 2})).await;
    assert_eq!(a.status, 400);
    assert_eq!(
        a.error(),
        r#"invalid arguments: "city" is a required property"#
    );
    let a = post_json(s, "/v1/tools/weather", &json!({"city": "Oslo", "days": 0})).await;
    assert_eq!(a.status, 400);
    assert_eq!(
        a.error(),
        "invalid arguments at /days: value is less than the minimum of 1"
    );
    let a = post_json(s, "/v1/tools/weather", &json!({"city": "Oslo", "evil": 1})).await;
    assert_eq!(a.status, 400);
    assert_eq!(
        a.error(),
        "invalid arguments: Additional properties are not allowed ('evil' was unexpected)"
    );
    let a = post_json(s, "/v1/tools/weather", &json!(["Oslo"])).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.error(), "the request body must be a JSON object");
    assert!(seen.lock().unwrap().is_empty(), "a handler ran");
}

#[tokio::test]
async fn unknown_tools_and_routes_are_refused() {
    let (_, broker) = weather_broker().await;
    let turn = start_turn(&broker).await;
    let s = turn.socket();
    let a = post_json(s, "/v1/tools/rm-rf", &json!({})).await;
    assert_eq!(a.status, 404);
    assert_eq!(a.json(), json!({"error": "unknown tool: rm-rf"}));
    let a = post_json(s, "/v1/mcp/time/get_current_time", &json!({})).await;
    assert_eq!(a.status, 404);
    assert_eq!(a.error(), "unknown MCP tool: time/get_current_time");
    let a = post_json(s, "/v1/models", &json!({})).await;
    assert_eq!(a.status, 404);
    assert_eq!(a.error(), "not found");
    let (status, _, _) = client::send(s, "GET", "/v1/tools/weather", &[], "")
        .await
        .unwrap();
    assert_eq!(status, 405);
    let a = post(s, "/v1/tools/weather/x", &[], "{}").await.unwrap();
    assert_eq!(a.status, 404);
}
