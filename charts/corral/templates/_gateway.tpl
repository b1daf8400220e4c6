{{/* The gateway's discovery rule: read-only, on the one resource its discovery source watches. */}}
{{- define "corral.gateway.rules" -}}
{{- if eq .Values.gateway.discovery.source "pods" }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
{{- else }}
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
{{- end }}
# Served names and aliases come from the LLMDeployments; patch sets the wake annotation at zero.
- apiGroups: ["corral.dev"]
  resources: ["llmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/* The namespaces the gateway watches, as JSON (`include ... | fromJsonArray`): gateway.discovery.namespaces,
else the deprecated one-namespace key, else the operator's; empty: every namespace (a ClusterRole). */}}
{{- define "corral.gateway.namespaces" -}}
{{- $d := .Values.gateway.discovery }}
{{- if and $d.namespace $d.namespaces }}
{{- fail "gateway.discovery.namespace is the deprecated one-namespace form of gateway.discovery.namespaces: set only namespaces" }}
{{- end }}
{{- $d.namespaces | default (compact (list $d.namespace)) | default .Values.operator.namespaces | default (list) | uniq | toJson }}
{{- end }}

{{/* The gateway's settings file (`corral gateway --config`); gateway.config adds to it. */}}
{{- define "corral.gateway.config" -}}
{{- $gw := .Values.gateway }}
{{- $k8s := dict "enabled" true "source" $gw.discovery.source "label_selector" $gw.discovery.labelSelector }}
{{- with include "corral.gateway.namespaces" . | fromJsonArray }}{{ $_ := set $k8s "namespaces" . }}{{ end }}
{{- $cfg := dict "host" "0.0.0.0" "port" ($gw.containerPort | int) "policy" $gw.policy "kubernetes" $k8s "drain_timeout_s" ($gw.drainTimeoutSeconds | int) }}
{{- if $gw.apiKeys.existingSecret }}
{{- $_ := set $cfg "api_keys_file" (printf "/etc/corral/api-keys/%s" $gw.apiKeys.secretKey) }}
{{- end }}
{{- toYaml (mergeOverwrite $cfg (deepCopy $gw.config)) }}
{{- end }}
