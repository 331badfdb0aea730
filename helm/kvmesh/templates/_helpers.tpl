{{/* Full name of the release's objects, at most 63 characters. */}}
{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Standard app.kubernetes.io labels. */}}
{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvmesh
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component. Call with (dict "ctx" $ "component" "operator"). */}}
{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules for the kinds an InferenceService owns, used by the ClusterRole or each Role. */}}
{{- define "kvmesh.namespacedRules" -}}
- apiGroups: ["kvmesh.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvmesh.io"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["kvmesh.io"]
  resources: ["inferenceservices/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["ingresses", "networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: {{ if .Values.rbac.inferencePool }}["get", "list", "watch"]{{ else }}["list"]{{ end }}
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.rbac.hpa }}
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.keda }}
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.inferencePool }}
{{- /* NOTE: router.mode inference-pool: the pool, and the endpoint picker's identity and rights. The
       operator can grant the picker only what it holds itself (RBAC escalation check): pods
       get/list/watch (above), inferencepools and inferenceobjectives get/list/watch. */}}
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["inference.networking.x-k8s.io"]
  resources: ["inferenceobjectives"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- /* NOTE: create (not read) Secrets: the managed Redis' generated password. Reading any Secret
       of a namespace is opt-in: rbac.readSecrets (get), rbac.watchSecrets (get, list, watch). */}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: {{ if .Values.rbac.watchSecrets }}["get", "list", "watch", "create"]{{ else if .Values.rbac.readSecrets }}["get", "create"]{{ else }}["create"]{{ end }}
{{- end -}}
