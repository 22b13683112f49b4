//! A Hugging Face chat template, compiled once and rendered per request.
//!
//! transformers renders templates in a Jinja2 sandbox with `trim_blocks` and `lstrip_blocks` on,
//! the loop-controls extension, and its own globals: `raise_exception(message)`,
//! `strftime_now(format)`, and a `tojson` that is Python's `json.dumps` (no HTML escaping,
//! `", "` and `": "` separators, keys in their order). The environment here matches that;
//! Python's string and dict methods come from minijinja-contrib's pycompat.

use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};

use super::error::TokenizeError;

const NAME: &str = "chat";

/// A compiled chat template and where it came from (named in errors).
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    /// Whether the template loops over a message's `content` (so it wants content as a list of
    /// parts, vLLM's "openai" content format) rather than printing it (a string).
    pub wants_parts: bool,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("wants_parts", &self.wants_parts)
            .finish()
    }
}

/// The error `raise_exception` returns, found again in the render error's sources so that a
/// template's deliberate refusal is told apart from a template bug.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Compiles `source`; `origin` names it in errors (a path, or "tokenizer_config.json").
    pub fn new(source: String, origin: String) -> Result<ChatTemplate, TokenizeError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizeError::Template {
                origin: origin.clone(),
                detail: e.to_string(),
            })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: &str| super::strftime::now(format));
        env.add_filter("tojson", tojson);
        let wants_parts = loops_over_content(&source);
        env.add_template_owned(NAME, source)
            .map_err(|e| TokenizeError::Template {
                origin: origin.clone(),
                detail: describe(&e),
            })?;
        Ok(ChatTemplate {
            env,
            origin,
            wants_parts,
        })
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The template rendered with `context` (messages, tools, special tokens, ...).
    pub fn render(&self, context: Value) -> Result<String, TokenizeError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| TokenizeError::Template {
                origin: self.origin.clone(),
                detail: describe(&e),
            })?;
        template.render(context).map_err(|e| {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = source {
                if let Some(raised) = err.downcast_ref::<Raised>() {
                    return TokenizeError::Raised {
                        origin: self.origin.clone(),
                        message: raised.0.clone(),
                    };
                }
                source = err.source();
            }
            TokenizeError::Render {
                origin: self.origin.clone(),
                detail: describe(&e),
            }
        })
    }
}

/// A minijinja error with its line, for operators reading a load error.
fn describe(e: &Error) -> String {
    match e.line() {
        Some(line) => format!("line {line}: {e}"),
        None => e.to_string(),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` as transformers' `tojson`:
/// keys in their order, `", "`/`": "` separators without indent, no HTML escaping (minijinja's
/// own `tojson` escapes `<` and `>`, which would change the tokens).
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(indent) => Some(indent),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    // Accepted for compatibility; Python's defaults here are the ones transformers uses.
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let mut out = Vec::new();
    let result = match indent {
        Some(width) => {
            let spaces = vec![b' '; width];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
            serde::Serialize::serialize(value, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonSpaced);
            serde::Serialize::serialize(value, &mut ser)
        }
    };
    result.map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "JSON not UTF-8").with_source(e))?;
    Ok(Value::from_safe_string(text))
}

/// `json.dumps`' default separators: `", "` between items, `": "` after keys.
struct PythonSpaced;

impl serde_json::ser::Formatter for PythonSpaced {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// vLLM's content-format detection, approximated on the source: a `{% for ... in ... %}` whose
/// iterable names `content` means the template walks content parts (vLLM then gives every
/// message's content as a list of parts); otherwise content is a string (parts joined by "\n").
fn loops_over_content(source: &str) -> bool {
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let block = &rest[start + 2..];
        let end = block.find("%}").unwrap_or(block.len());
        let tag = block[..end].trim_start_matches(['-', '+']).trim_start();
        if let Some(head) = tag.strip_prefix("for ") {
            if let Some((_, iterable)) = head.split_once(" in ") {
                if iterable.contains("content") {
                    return true;
                }
            }
        }
        rest = &block[end..];
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, context: Value) -> Result<String, TokenizeError> {
        ChatTemplate::new(source.to_string(), "test".into())?.render(context)
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let tools: Value =
            serde_json::from_str(r#"{"b": [1, "<x>", null], "a": {"é": true}}"#).expect("json");
        let out = render("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}", {
            minijinja::context! { tools }
        })
        .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, \"<x>\", null], \"a\": {\"é\": true}}|{\n  \"b\": [\n    1,\n    \"<x>\",\n    null\n  ],\n  \"a\": {\n    \"é\": true\n  }\n}"
        );
    }

    #[test]
    fn raise_exception_is_a_refusal() {
        let err = render(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}",
            minijinja::context! { messages => vec![minijinja::context! { role => "assistant" }] },
        )
        .unwrap_err();
        match err {
            TokenizeError::Raised { origin, message } => {
                assert_eq!(origin, "test");
                assert_eq!(message, "roles must alternate");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn python_methods_loop_controls_and_whitespace() {
        let out = render(
            "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}{{ m.content.strip().upper() }};\n{% endfor %}\n",
            minijinja::context! { messages => vec![
                minijinja::context! { content => " a " },
                minijinja::context! { content => "b" },
                minijinja::context! { content => "c" },
            ] },
        )
        .unwrap();
        // lstrip_blocks drops the indent before a block tag, trim_blocks the newline after it,
        // and the template's final newline is dropped as Jinja2 does.
        assert_eq!(out, "A;\nB;\n");
    }

    #[test]
    fn bad_template_names_origin_and_line() {
        let err = ChatTemplate::new("ok\n{% for %}".into(), "x/chat_template.jinja".into())
            .unwrap_err()
            .to_string();
        assert!(err.contains("x/chat_template.jinja"), "{err}");
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn content_format_detection() {
        assert!(loops_over_content(
            "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
        ));
        assert!(loops_over_content("{%- for c in m.content -%}{% endfor %}"));
        assert!(!loops_over_content(
            "{% for message in messages %}{{ message['content'] }}{% endfor %}"
        ));
    }
}
