// The review page of one session (fsm_agent server). Plain JS, no build step, no network beyond
// this origin. Everything the server sends is shown with textContent, never parsed as HTML; the
// one exception is Mermaid's own SVG output, which Mermaid sanitises (securityLevel 'strict').
//
// The server is the source of truth: a pending tool call's box goes away only when the log says
// it was decided (a `resume` event naming its call id) or a snapshot no longer lists it, never on
// a click, so two open tabs stay consistent.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);

  // ---- session id and API paths -------------------------------------------------------------
  const m = location.pathname.match(/\/review\/([^/]+)\/?$/);
  const sid = m ? decodeURIComponent(m[1]) : '';
  const api = '/sessions/' + encodeURIComponent(sid);

  // Event types the page listens for (a named SSE event reaches only listeners of its name).
  const EVENT_TYPES = [
    'session_started', 'message', 'transition', 'model_call', 'model_call_interrupted', 'model_retry',
    'tool_call', 'control', 'control_dropped', 'resume', 'recovered', 'turn', 'run_stopped', 'warning',
    'budget_warning', 'cost_update', 'goal_changed', 'output_invalid', 'compensated', 'approval_requested',
    'tool_started', 'tool_finished', 'error', 'delta', 'state', 'plan_updated',
  ];
  const REDRAW_ON = new Set(['transition', 'run_stopped', 'recovered']);
  const MAX_EVENTS = 5000;
  const IDLE_POLL_MS = 2000;
  const IDLE_POLL_MAX_MS = 15000;

  // ---- page state -----------------------------------------------------------------------------
  let lastSeq = 0;            // the highest log seq shown
  let lastType = null;        // the type of that event
  let es = null;              // the EventSource, or null when closed
  let idleTimer = null;       // snapshot polling while the stream is closed
  let currentState = null;
  let knownStates = [];       // from the last diagram source, for the fallback list
  let diagramSource = '';
  let diagramTimer = null;
  let renderGen = 0;
  let mermaidReady = false;
  let planTimer = null;
  let planGen = 0;
  let signedOut = false;
  const usage = { input: 0, output: 0, cost: 0, priced: 0, unpriced: 0 };
  const pending = new Map();  // call id -> the box element
  const streaming = { text: '', thinking: '', refusal: '', tool_call: '' };
  let streamIndex;

  // ---- HTTP ------------------------------------------------------------------------------------
  function cookie(name) {
    for (const part of document.cookie.split(';')) {
      const i = part.indexOf('=');
      if (i >= 0 && part.slice(0, i).trim() === name) return decodeURIComponent(part.slice(i + 1).trim());
    }
    return null;
  }

  class HttpError extends Error {
    constructor(status, title, detail) {
      super(detail ? title + ': ' + detail : title);
      this.status = status; this.title = title; this.detail = detail;
    }
  }

  async function request(method, path, body) {
    const headers = { 'Accept': 'application/json, application/problem+json, text/plain' };
    const csrf = cookie('fsm_csrf');
    if (csrf !== null) headers['X-CSRF-Token'] = csrf;
    const init = { method, headers, credentials: 'same-origin', cache: 'no-store' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new HttpError(0, 'Network error', String(e && e.message || e));
    }
    if (resp.status === 401) showSignIn();
    if (!resp.ok) {
      let title = resp.status + ' ' + (resp.statusText || 'error');
      let detail = '';
      try {
        const text = await resp.text();
        try {
          const p = JSON.parse(text);
          if (p && typeof p === 'object') {
            if (p.title) title = resp.status + ' ' + p.title;
            if (p.detail) detail = String(p.detail);
          }
        } catch (_) { detail = text.slice(0, 500); }
      } catch (_) { /* no body */ }
      throw new HttpError(resp.status, title, detail);
    }
    return resp;
  }

  const getJSON = async (path) => (await request('GET', path)).json();
  const getText = async (path) => (await request('GET', path)).text();
  const postJSON = async (path, body) => {
    const resp = await request('POST', path, body);
    const t = await resp.text();
    try { return t ? JSON.parse(t) : null; } catch (_) { return t; }
  };

  // ---- sign-in ---------------------------------------------------------------------------------
  function showSignIn() {
    if (signedOut) return;
    signedOut = true;
    closeStream();
    stopIdlePoll();
    $('signin').hidden = false;
    $('main').hidden = true;
    setConn('signed out');
    $('signin-token').focus();
  }

  $('signin-form').addEventListener('submit', async (ev) => {
    ev.preventDefault();
    $('signin-error').textContent = '';
    const token = $('signin-token').value;
    try {
      const resp = await fetch('/auth/login', {
        method: 'POST', credentials: 'same-origin', cache: 'no-store',
        headers: { 'Content-Type': 'application/json', 'Accept': 'application/json, application/problem+json' },
        body: JSON.stringify({ token }),
      });
      if (!resp.ok) {
        let msg = resp.status + ' ' + resp.statusText;
        try { const p = await resp.json(); msg = resp.status + ' ' + (p.title || '') + (p.detail ? ': ' + p.detail : ''); } catch (_) { /* keep */ }
        $('signin-error').textContent = msg;
        return;
      }
      location.reload();
    } catch (e) {
      $('signin-error').textContent = 'Network error: ' + String(e && e.message || e);
    }
  });

  // ---- small display helpers -------------------------------------------------------------------
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    if (props) {
      for (const [k, v] of Object.entries(props)) {
        if (v === undefined || v === null) continue;
        if (k === 'text') e.textContent = v;
        else if (k === 'class') e.className = v;
        else if (k === 'dataset') Object.assign(e.dataset, v);
        else if (k in e && typeof v !== 'string') e[k] = v;
        else e.setAttribute(k, v);
      }
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  function setConn(text) { $('conn').textContent = text; }
  function showError(text) { $('error').textContent = text || ''; }

  function fmtTime(ts) {
    if (typeof ts !== 'number') return '';
    const d = new Date(ts > 1e12 ? ts : ts * 1000);
    return d.toLocaleTimeString([], { hour12: false });
  }

  function clip(s, n) {
    s = String(s);
    return s.length > n ? s.slice(0, n) + '…' : s;
  }

  function compact(v) {
    try { return JSON.stringify(v); } catch (_) { return String(v); }
  }

  function pretty(v) {
    try { return JSON.stringify(v, null, 2); } catch (_) { return String(v); }
  }

  // ---- messages --------------------------------------------------------------------------------
  function partText(p) {
    if (p === null || p === undefined) return '';
    if (typeof p === 'string') return p;
    switch (p.type) {
      case 'text': return p.text || '';
      case 'thinking': return '(thinking) ' + (p.thinking || p.text || '');
      case 'tool_use': return '→ ' + p.name + '(' + compact(p.input !== undefined ? p.input : p.arguments) + ') [' + p.id + ']';
      case 'tool_result': return '← ' + (p.tool_use_id || '') + ' ' + contentText(p.content);
      case 'image': return '[image]';
      case 'audio': return '[audio]';
      case 'file': return '[file' + (p.name ? ' ' + p.name : '') + ']';
      case 'refusal': return '(refusal) ' + (p.text || p.refusal || '');
      default: return p.text !== undefined ? String(p.text) : '[' + (p.type || 'part') + ']';
    }
  }

  function contentText(content) {
    if (content === null || content === undefined) return '';
    if (typeof content === 'string') return content;
    if (Array.isArray(content)) return content.map(partText).filter(Boolean).join('\n');
    return partText(content);
  }

  function messageText(msg) {
    if (!msg || typeof msg !== 'object') return String(msg);
    const role = msg.role || '?';
    let text = msg.text !== undefined && msg.content === undefined ? String(msg.text) : contentText(msg.content);
    if (role === 'tool') {
      text = (msg.name || 'tool') + ' [' + (msg.tool_call_id || '') + ']' + (msg.is_error ? ' (error)' : '') + ': ' + text;
    }
    return role + ': ' + text;
  }

  // ---- the event list --------------------------------------------------------------------------
  function summary(type, p) {
    p = p || {};
    switch (type) {
      case 'session_started': return 'goal: ' + clip(p.goal === undefined ? '' : p.goal, 400);
      case 'message': return clip(messageText(p.message), 4000);
      case 'transition': return p.from + ' —' + p.trigger + '→ ' + p.to + (p.reason ? '  (' + p.reason + ')' : '');
      case 'plan_updated': return 'plan v' + ((p.plan || {}).version || '?') + ': ' + clip(p.reason || '', 400);
      case 'model_call': {
        const u = p.usage || {};
        const cost = typeof p.cost_usd === 'number' ? ', $' + p.cost_usd.toFixed(6) : '';
        const model = String(p.model || '').split('/').pop();  // a local model's name is a file path
        return model + ' · ' + (p.stop_reason || '') + ' · ' + (u.input_tokens || 0) + ' in / ' +
          (u.output_tokens || 0) + ' out' + cost;
      }
      case 'tool_call': return (p.tool || '') + ' [' + (p.call_id || '') + '] ' + (p.status || '');
      case 'control': return (p.kind || '') + (p.text ? ': ' + clip(p.text, 400) : '');
      case 'resume': {
        const d = p.decisions || {};
        const parts = Object.entries(d).map(([id, v]) =>
          id + ' → ' + (v && typeof v === 'object' ? (v.kind || v.decision || compact(v)) : String(v)));
        return parts.length ? 'decisions: ' + parts.join(', ') : 'resumed';
      }
      case 'run_stopped': {
        const s = p.stop || {};
        const n = (s.pending_actions || []).length;
        return (s.reason || '') + (s.detail ? ': ' + s.detail : '') + (n ? '  (' + n + ' pending)' : '');
      }
      case 'turn': {
        const t = p.turn || {};
        return 'turn ' + t.turn + (t.stop_reason ? ' · ' + t.stop_reason : '') +
          ((t.tool_calls || []).length ? ' · calls ' + t.tool_calls.join(', ') : '');
      }
      default: return clip(compact(p), 600);
    }
  }

  function addEventRow(ev) {
    const list = $('events');
    const li = el('li', { class: 'ev-' + ev.type, dataset: { seq: String(ev.seq), type: ev.type } },
      el('span', { class: 'seq mono', text: '#' + ev.seq }),
      el('span', { class: 'ts mono', text: fmtTime(ev.ts) }),
      el('span', { class: 'type', text: ev.type }),
      el('span', { class: 'text', text: summary(ev.type, ev.payload) }));
    list.append(li);
    while (list.childElementCount > MAX_EVENTS) list.firstElementChild.remove();
    const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 120;
    if (nearBottom) list.scrollTop = list.scrollHeight;
  }

  function clearStreaming() {
    streaming.text = streaming.thinking = streaming.refusal = streaming.tool_call = '';
    streamIndex = undefined;
    const s = $('streaming');
    s.textContent = '';
    s.hidden = true;
  }

  function onDelta(data) {
    if (!data || typeof data !== 'object') return;
    const kind = data.kind in streaming ? data.kind : 'text';
    let piece = data.text !== undefined && data.text !== null ? String(data.text) : '';
    // a new tool call (another index) starts on a new line
    if (kind === 'tool_call' && data.index !== undefined && data.index !== streamIndex && streaming.tool_call) piece = '\n' + piece;
    if (kind === 'tool_call') streamIndex = data.index;
    streaming[kind] += piece;
    const lines = [];
    if (streaming.thinking) lines.push('thinking: ' + tail(streaming.thinking, 4000));
    if (streaming.text) lines.push('streaming: ' + tail(streaming.text, 8000));
    if (streaming.refusal) lines.push('refusal: ' + tail(streaming.refusal, 4000));
    if (streaming.tool_call) lines.push('tool call arguments: ' + tail(streaming.tool_call, 4000));
    const s = $('streaming');
    s.textContent = lines.join('\n');
    s.hidden = lines.length === 0;
  }

  function tail(s, n) { return s.length > n ? '…' + s.slice(s.length - n) : s; }

  // ---- state, usage, goal ----------------------------------------------------------------------
  function setState(name) {
    if (!name || name === currentState) return;
    currentState = name;
    const s = $('state');
    s.textContent = name;
    s.dataset.state = name;
    markActiveNode();
    renderFallbackStates();
    updateControls();
  }

  // The controls the session can take in its state (the server refuses the others): none once it
  // ended for good; no Interrupt while it is stopped (nothing runs), though Cancel, Steer and
  // Follow up resume a resumable stop to apply.
  const ENDED = new Set(['COMPLETED', 'FAILED_TERMINAL', 'CANCELLED']);
  const RESUMABLE = new Set(['WAITING_HUMAN', 'PAUSED_BUDGET', 'INTERRUPTED', 'FAILED_RETRYABLE']);

  function updateControls() {
    const ended = ENDED.has(currentState);
    const stopped = ended || RESUMABLE.has(currentState);
    for (const id of ['btn-cancel', 'btn-steer', 'btn-followup', 'steer-text']) $(id).disabled = ended;
    $('btn-interrupt').disabled = stopped;
    $('control-note').textContent = ended
      ? 'The session ended ' + currentState + ': it takes no more controls.'
      : (stopped ? 'Stopped ' + currentState + ': nothing runs to interrupt; Cancel, Steer and Follow up resume it to apply.' : '');
  }

  function showUsage() {
    let t = usage.input + ' in / ' + usage.output + ' out tokens';
    if (usage.priced) t += ' · $' + usage.cost.toFixed(6);
    if (usage.unpriced) t += usage.priced ? ' (+' + usage.unpriced + ' unpriced call(s))' : ' · cost unknown';
    $('usage').textContent = t;
  }

  function onModelCall(p) {
    const u = (p && p.usage) || {};
    usage.input += Number(u.input_tokens) || 0;
    usage.output += Number(u.output_tokens) || 0;
    if (typeof p.cost_usd === 'number') { usage.cost += p.cost_usd; usage.priced += 1; } else usage.unpriced += 1;
    showUsage();
  }

  function showStop(stop) {
    const d = $('stop-detail');
    if (!stop || !stop.reason) { d.textContent = ''; return; }
    d.textContent = 'Stopped: ' + stop.reason + (stop.detail ? ' — ' + stop.detail : '') +
      (stop.required_decision ? ' (' + stop.required_decision + ')' : '');
  }

  // ---- pending tool calls ----------------------------------------------------------------------
  function callOf(action) {
    const c = (action && action.call) || {};
    const args = c.arguments !== undefined ? c.arguments : c.input;
    return { id: c.id, name: c.name, args: args === undefined || args === null ? {} : args };
  }

  function setPending(actions) {
    // The server's current set: add the new boxes, drop the ones it no longer lists.
    const want = new Map();
    for (const a of actions || []) {
      const c = callOf(a);
      if (c.id) want.set(String(c.id), a);
    }
    for (const id of [...pending.keys()]) if (!want.has(id)) removePending(id);
    for (const [id, a] of want) if (!pending.has(id)) addPending(id, a);
    updateNonePending();
  }

  function removePending(id) {
    const box = pending.get(id);
    if (box) box.remove();
    pending.delete(id);
    updateNonePending();
  }

  function updateNonePending() { $('none-pending').hidden = pending.size > 0; }

  function addPending(id, action) {
    const c = callOf(action);
    const allowed = (action.allowed_decisions && action.allowed_decisions.length)
      ? action.allowed_decisions : ['approve', 'edit', 'reject', 'respond'];
    const errorP = el('p', { class: 'error', role: 'alert' });
    const status = el('p', { class: 'sent', 'aria-live': 'polite' });
    const box = el('div', { class: 'pending', dataset: { callId: id }, role: 'group', 'aria-label': 'Tool call ' + c.name },
      el('h3', null, 'Tool ', el('code', { text: String(c.name) }), el('span', { class: 'mono', text: '  [' + id + ']' })),
      action.reason ? el('p', { class: 'reason', text: action.reason }) : null,
      el('pre', { class: 'args', text: pretty(c.args) }));
    const buttons = [];

    async function decide(decision, extra) {
      errorP.textContent = '';
      for (const b of buttons) b.disabled = true;
      status.textContent = 'Sending ' + decision + '…';
      try {
        await postJSON(api + '/approvals/' + encodeURIComponent(id), Object.assign({ decision }, extra || {}));
        status.textContent = decision + ' sent; waiting for the server to record it…';
        activity();
      } catch (e) {
        status.textContent = '';
        errorP.textContent = e instanceof HttpError ? e.message : String(e);
        for (const b of buttons) b.disabled = false;
      }
    }

    const uid = 'p-' + Math.random().toString(36).slice(2, 9);
    if (allowed.includes('approve')) {
      const b = el('button', { type: 'button', class: 'primary', text: 'Approve', dataset: { decision: 'approve' } });
      b.addEventListener('click', () => decide('approve'));
      buttons.push(b);
      box.append(el('div', { class: 'decision' }, b));
    }
    if (allowed.includes('edit')) {
      const ta = el('textarea', { id: uid + '-edit', spellcheck: false, 'aria-label': 'New arguments (JSON)' });
      ta.value = pretty(c.args);
      const b = el('button', { type: 'button', text: 'Run with these arguments', dataset: { decision: 'edit' } });
      b.addEventListener('click', () => {
        let args;
        try { args = JSON.parse(ta.value); } catch (e) { errorP.textContent = 'The arguments are not valid JSON: ' + e.message; return; }
        if (args === null || typeof args !== 'object' || Array.isArray(args)) {
          errorP.textContent = 'The arguments must be a JSON object.'; return;
        }
        decide('edit', { arguments: args });
      });
      buttons.push(b);
      box.append(el('details', { class: 'decision-edit' }, el('summary', { text: 'Edit arguments' }),
        el('label', { for: uid + '-edit', class: 'visually-hidden', text: 'New arguments (JSON)' }), ta,
        el('div', { class: 'decision' }, b)));
    }
    if (allowed.includes('reject')) {
      const inp = el('input', { type: 'text', id: uid + '-reject', placeholder: 'Why not (sent to the model)' });
      const b = el('button', { type: 'button', class: 'danger', text: 'Reject', dataset: { decision: 'reject' } });
      b.addEventListener('click', () => decide('reject', inp.value ? { message: inp.value } : {}));
      buttons.push(b);
      box.append(el('div', { class: 'decision' },
        el('label', { for: uid + '-reject', class: 'visually-hidden', text: 'Reason for rejecting' }), inp, b));
    }
    if (allowed.includes('respond')) {
      const inp = el('input', { type: 'text', id: uid + '-respond', placeholder: 'Result to give the model instead' });
      const b = el('button', { type: 'button', text: 'Respond', dataset: { decision: 'respond' } });
      b.addEventListener('click', () => decide('respond', { message: inp.value }));
      buttons.push(b);
      box.append(el('div', { class: 'decision' },
        el('label', { for: uid + '-respond', class: 'visually-hidden', text: 'Result text' }), inp, b));
    }
    box.append(status, errorP);
    pending.set(id, box);
    $('pending').append(box);
  }

  // ---- controls --------------------------------------------------------------------------------
  async function control(kind, withText) {
    const body = { kind };
    if (withText) {
      const t = $('steer-text').value.trim();
      if (!t) { $('control-error').textContent = 'Write a message first.'; $('steer-text').focus(); return; }
      body.text = t;
    }
    $('control-error').textContent = '';
    $('control-status').textContent = 'Sending ' + kind + '…';
    try {
      await postJSON(api + '/control', body);
      $('control-status').textContent = kind + ' sent.';
      if (withText) $('steer-text').value = '';
      activity();
    } catch (e) {
      $('control-status').textContent = '';
      $('control-error').textContent = e instanceof HttpError ? e.message : String(e);
    }
  }
  $('btn-interrupt').addEventListener('click', () => control('interrupt', false));
  $('btn-cancel').addEventListener('click', () => control('cancel', false));
  $('btn-steer').addEventListener('click', () => control('steer', true));
  $('btn-followup').addEventListener('click', () => control('followup', true));
  $('steer-text').addEventListener('keydown', (e) => { if (e.key === 'Enter') control('steer', true); });
  $('btn-zoom').addEventListener('click', () => {
    const on = $('diagram').classList.toggle('actual-size');
    $('btn-zoom').setAttribute('aria-pressed', String(on));
    $('btn-zoom').textContent = on ? 'Fit to width' : 'Actual size';
    applyZoom();
  });

  // Mermaid sizes its SVG with width="100%" and an inline max-width: it always fits the box. The
  // natural size is the viewBox's; "Actual size" sets it (the box then scrolls), "Fit to width"
  // gives the box's width back.
  function applyZoom() {
    const svg = $('diagram').querySelector('svg');
    if (!svg) return;
    const box = svg.viewBox && svg.viewBox.baseVal;
    if ($('diagram').classList.contains('actual-size') && box && box.width > 0) {
      svg.setAttribute('width', String(Math.ceil(box.width)));
      svg.setAttribute('height', String(Math.ceil(box.height)));
      svg.style.maxWidth = 'none';
    } else {  // Mermaid's own: the box's width, never above the natural one
      svg.setAttribute('width', '100%');
      svg.removeAttribute('height');
      svg.style.maxWidth = box && box.width > 0 ? Math.ceil(box.width) + 'px' : '100%';
    }
  }

  // ---- the diagram -----------------------------------------------------------------------------
  function statesOf(src) {
    const seen = new Set();
    // a state diagram's `A --> B: label`, a flowchart's `A -->|"label"| B` or `A -.->|"label"| B`
    const re = /^\s*([A-Za-z_][\w]*)\s*(?:-->|-\.->)\s*(?:\|[^|]*\|\s*)?([A-Za-z_][\w]*)/;
    for (const line of src.split('\n')) {
      const mm = line.match(re);
      if (mm) { seen.add(mm[1]); seen.add(mm[2]); }
    }
    seen.delete('start');  // the flowchart's start marker
    return [...seen];
  }

  function renderFallbackStates() {
    const ul = $('diagram-states');
    if ($('diagram-fallback').hidden) return;
    const names = knownStates.length ? knownStates : (currentState ? [currentState] : []);
    ul.replaceChildren(...names.map((n) => n === currentState
      ? el('li', { class: 'current', 'aria-current': 'step' }, el('strong', { text: n }))
      : el('li', { text: n })));
  }

  function showFallback(note) {
    $('diagram').replaceChildren();
    $('diagram').hidden = true;
    $('diagram-fallback').hidden = false;
    $('diagram-fallback-note').textContent = note;
    $('diagram-source').textContent = diagramSource;
    renderFallbackStates();
  }

  function markActiveNode() {
    const svg = $('diagram').querySelector('svg');
    if (svg) {
      for (const n of svg.querySelectorAll('.active-node')) n.classList.remove('active-node');
      if (currentState) {
        // a state diagram's node is <id>-state-NAME-<n>; a flowchart's (a run's path) <id>-flowchart-NAME-<n>
        const needles = ['-state-' + currentState + '-', '-flowchart-' + currentState + '-'];
        for (const g of svg.querySelectorAll('g[id]')) {
          if (needles.some((n) => g.id.includes(n))) g.classList.add('active-node');
        }
      }
    }
    $('diagram').setAttribute('aria-label', 'State diagram; current state: ' + (currentState || 'unknown'));
  }

  function scheduleDiagram(delay) {
    clearTimeout(diagramTimer);
    diagramTimer = setTimeout(drawDiagram, delay === undefined ? 200 : delay);
  }

  async function drawDiagram() {
    const gen = ++renderGen;
    let src;
    try {
      src = await getText(api + '/diagram');
    } catch (e) {
      if (gen !== renderGen) return;
      if (!diagramSource) showFallback('The diagram is not available: ' + (e.message || e));
      return;
    }
    if (gen !== renderGen) return;
    diagramSource = src;
    knownStates = statesOf(src);
    $('diagram-source').textContent = src;
    if (!mermaidReady) { showFallback('The diagram renderer (mermaid.min.js) did not load; here is its source.'); return; }
    try {
      const { svg } = await window.mermaid.render('fsmdiagram' + gen, src);
      if (gen !== renderGen) return;
      // Mermaid's output, sanitised by Mermaid itself (securityLevel 'strict'); parsed in an inert
      // document, then adopted.
      const doc = new DOMParser().parseFromString(svg, 'text/html');
      const node = doc.querySelector('svg');
      if (!node) throw new Error('no SVG in the renderer output');
      $('diagram').replaceChildren(document.importNode(node, true));
      $('diagram').hidden = false;
      $('diagram-fallback').hidden = true;
      applyZoom();
      markActiveNode();
    } catch (e) {
      if (gen !== renderGen) return;
      showFallback('The diagram could not be rendered (' + (e && e.message ? e.message : e) + '); here is its source.');
      // mermaid may leave its scratch element behind on failure
      const scratch = document.getElementById('dfsmdiagram' + gen);
      if (scratch) scratch.remove();
    }
  }

  // ---- the plan (PlanAct) -----------------------------------------------------------------------
  // Shown only when the session has one: the server's flowchart (plan_mermaid), or its source when
  // Mermaid cannot render it.
  function schedulePlan(delay) {
    clearTimeout(planTimer);
    planTimer = setTimeout(drawPlan, delay === undefined ? 200 : delay);
  }

  async function drawPlan() {
    const gen = ++planGen;
    let doc;
    try {
      doc = await getJSON(api + '/diagram?format=json');
    } catch (e) {
      return;  // the machine diagram reports the error
    }
    if (gen !== planGen) return;
    const src = doc && doc.plan_mermaid;
    if (!src) { $('plan-area').hidden = true; return; }
    $('plan-area').hidden = false;
    $('plan-source').textContent = src;
    const plan = doc.plan || {};
    const nodes = plan.nodes || [];
    const passed = nodes.filter((n) => n.status === 'passed').length;
    $('plan-title').textContent = 'Plan v' + plan.version + ' (' + passed + ' of ' +
      nodes.filter((n) => n.status !== 'skipped').length + ' nodes passed)';
    if (!mermaidReady) { $('plan-source').hidden = false; return; }
    try {
      const { svg } = await window.mermaid.render('fsmplan' + gen, src);
      if (gen !== planGen) return;
      const node = new DOMParser().parseFromString(svg, 'text/html').querySelector('svg');
      if (!node) throw new Error('no SVG in the renderer output');
      $('plan-diagram').replaceChildren(document.importNode(node, true));
      $('plan-source').hidden = true;
      const current = nodes.find((n) => n.status === 'running');
      $('plan-diagram').setAttribute('aria-label', 'Plan diagram; current node: ' + (current ? current.id : 'none'));
    } catch (e) {
      if (gen !== planGen) return;
      $('plan-diagram').replaceChildren();
      $('plan-source').hidden = false;
      const scratch = document.getElementById('dfsmplan' + gen);
      if (scratch) scratch.remove();
    }
  }

  // ---- applying one log event ------------------------------------------------------------------
  function apply(ev) {
    if (typeof ev.seq === 'number') {
      if (ev.seq <= lastSeq) return;   // already shown (a replay overlap)
      if (ev.seq > lastSeq + 1) {
        // events of a type this page does not listen for (a named SSE event reaches only its listeners)
        const n = ev.seq - lastSeq - 1;
        $('events').append(el('li', { class: 'ev-gap', dataset: { type: 'gap' } }, el('span'), el('span'), el('span'),
          el('span', { class: 'text', text: '(' + n + ' event(s) of other types not shown: #' + (lastSeq + 1) +
            (n > 1 ? '–#' + (ev.seq - 1) : '') + ')' })));
      }
      lastSeq = ev.seq;
      lastType = ev.type;
    }
    addEventRow(ev);
    const p = ev.payload || {};
    switch (ev.type) {
      case 'session_started':
        if (p.goal !== undefined) $('goal').textContent = typeof p.goal === 'string' ? p.goal : pretty(p.goal);
        break;
      case 'goal_changed':
        if (p.goal !== undefined) $('goal').textContent = typeof p.goal === 'string' ? p.goal : pretty(p.goal);
        break;
      case 'message':
        clearStreaming();
        break;
      case 'transition':
        setState(p.to);
        showStop(null);
        break;
      case 'recovered':
        if (p.state) setState(p.state);
        break;
      case 'model_call':
        onModelCall(p);
        break;
      case 'resume':
        for (const id of Object.keys(p.decisions || {})) removePending(id);
        break;
      case 'run_stopped': {
        const stop = p.stop || {};
        clearStreaming();
        if (stop.reason) setState(stop.reason);
        showStop(stop);
        setPending(stop.pending_actions || []);
        break;
      }
      default:
        break;
    }
    if (REDRAW_ON.has(ev.type)) scheduleDiagram();
    if (ev.type === 'plan_updated') schedulePlan();
  }

  // ---- the event stream ------------------------------------------------------------------------
  function onSSE(e) {
    if (e.type === 'state') {  // live only (no id): the machine moved; its transition event follows when committed
      let d = null;
      try { d = JSON.parse(e.data); } catch (_) { return; }
      if (d && typeof d.to === 'string') setState(d.to);
      return;
    }
    if (e.type === 'delta') {
      let d = null;
      try { d = JSON.parse(e.data); } catch (_) { return; }
      onDelta(d);
      return;
    }
    let ev;
    try { ev = JSON.parse(e.data); } catch (_) { return; }
    if (!ev || typeof ev !== 'object') return;
    if (ev.type === undefined) ev.type = e.type;
    if (typeof ev.seq !== 'number' && e.lastEventId) ev.seq = Number(e.lastEventId);
    if (ev.type === 'delta') { onDelta(ev); return; }
    apply(ev);
  }

  function openStream() {
    if (es || signedOut) return;
    stopIdlePoll();
    setConn('connecting…');
    const src = new EventSource(api + '/events?after=' + lastSeq, { withCredentials: false });
    es = src;
    for (const t of new Set(EVENT_TYPES)) src.addEventListener(t, onSSE);
    src.onmessage = onSSE;  // unnamed events, if any
    src.onopen = () => { if (es === src) setConn('live'); };
    src.onerror = () => {
      if (es !== src) return;
      if (src.readyState === EventSource.CLOSED) {
        // The server refused the stream (not 200 or not text/event-stream): it will not retry.
        closeStream();
        setConn('disconnected');
        checkSession();
        startIdlePoll();
      } else if (lastType === 'run_stopped') {
        // The server closes the stream after the terminal event: stop, or EventSource reconnects forever.
        closeStream();
        setConn('closed (run stopped)');
        refreshSnapshot();
        scheduleDiagram(0);
        startIdlePoll();
      } else {
        setConn('reconnecting…');  // EventSource retries by itself with Last-Event-ID
      }
    };
  }

  function closeStream() {
    if (es) { es.close(); es = null; }
  }

  // While the stream is closed (the run stopped), poll the snapshot: a decision or control sent from
  // another tab or client starts a new run, and the page reopens the stream when the log grows.
  // Every 2 s at first, slowing down to every 15 s while nothing happens.
  function startIdlePoll() {
    stopIdlePoll();
    if (signedOut) return;
    let delay = IDLE_POLL_MS;
    const tick = async () => {
      idleTimer = null;
      if (es || signedOut) return;
      await refreshSnapshot();
      if (es || signedOut) return;
      delay = Math.min(delay * 1.25, IDLE_POLL_MAX_MS);
      idleTimer = setTimeout(tick, delay);
    };
    idleTimer = setTimeout(tick, delay);
  }

  function stopIdlePoll() {
    if (idleTimer !== null) { clearTimeout(idleTimer); idleTimer = null; }
  }

  // The user started something: the run resumes, so listen again from the last event seen.
  function activity() {
    if (!es) openStream();
    setTimeout(refreshSnapshot, 300);
  }

  async function checkSession() {
    try { await request('GET', api); } catch (e) {
      if (e instanceof HttpError && e.status !== 401) showError(e.message);
    }
  }

  let snapshotBusy = false;
  async function refreshSnapshot() {
    if (snapshotBusy || signedOut) return;
    snapshotBusy = true;
    try {
      const snap = await getJSON(api);
      applySnapshot(snap);
      // the log grew, or a run is queued or running (the server keeps a stream open while it runs)
      if (!es && ((typeof snap.last_seq === 'number' && snap.last_seq > lastSeq) || snap.running === true)) openStream();
    } catch (e) {
      if (e instanceof HttpError && e.status !== 401) showError(e.message);
    } finally {
      snapshotBusy = false;
    }
  }

  function applySnapshot(snap) {
    if (!snap || typeof snap !== 'object') return;
    showError('');
    // Only a snapshot at least as new as what the page shows may change the state and the pending set.
    const fresh = typeof snap.last_seq !== 'number' || snap.last_seq >= lastSeq;
    if (snap.goal !== undefined && snap.goal !== null && $('goal').textContent === '…') {
      $('goal').textContent = typeof snap.goal === 'string' ? snap.goal : pretty(snap.goal);
    }
    if (!fresh) return;
    if (snap.state) setState(snap.state);
    // A stop's pending calls are pending only while the session still waits in that stop.
    const stopped = snap.stop && snap.stop.reason && (!snap.state || snap.state === snap.stop.reason);
    showStop(stopped ? snap.stop : null);
    setPending(stopped ? (snap.pending_approvals || []) : []);
  }

  // ---- start -----------------------------------------------------------------------------------
  async function start() {
    $('sid').textContent = sid || '(none)';
    document.title = 'Session ' + sid + ' · fsm_agent review';
    updateNonePending();
    updateControls();
    if (!sid) { showError('No session id in this address: open /review/<session id>.'); return; }
    if (window.mermaid && typeof window.mermaid.render === 'function') {
      try {
        window.mermaid.initialize({
          startOnLoad: false, securityLevel: 'strict', theme: 'default',
          fontFamily: 'system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif',
        });
        mermaidReady = true;
      } catch (e) { mermaidReady = false; }
    }
    try {
      applySnapshot(await getJSON(api));
    } catch (e) {
      if (!(e instanceof HttpError && e.status === 401)) showError(e.message || String(e));
      if (signedOut) return;
      if (e instanceof HttpError && e.status === 404) { setConn('no such session'); return; }
    }
    scheduleDiagram(0);
    schedulePlan(0);
    openStream();
  }

  // Expose a little for tests and debugging (read-only view of the page's own state).
  window.fsmReview = Object.freeze({
    get lastSeq() { return lastSeq; },
    get state() { return currentState; },
    get streamOpen() { return es !== null; },
    get pending() { return [...pending.keys()]; },
  });

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
